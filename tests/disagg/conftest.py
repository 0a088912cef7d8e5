"""tests/disagg: the PD roles and the handoff (sparkrelay/disagg/) in process: role events, the
handoff's parts and schema, stage reports."""
