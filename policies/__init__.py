"""policies: pure decision functions (gates, statistics) and the promotion controller.

Decides from metrics; never touches tensors.
"""
