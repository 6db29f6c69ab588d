"""trainer: data pipelines, training-time-test (TTT) loss and the head trainers (offline, near-line).

Reads targets and heads from adaptive_eagle; never serves requests.
"""
