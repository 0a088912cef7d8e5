"""tests/spec: speculative verification (sparkrelay/spec/): the greedy rule and rejection sampling's
distribution."""
