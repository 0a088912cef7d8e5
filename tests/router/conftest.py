"""tests/router: the PD router (sparkrelay/router/, launch_router) against stub workers."""
