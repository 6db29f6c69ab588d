"""feature_store: stores traces and hidden states (Redis streams, local Arrow segments).

Knows nothing of models or Ray.
"""
