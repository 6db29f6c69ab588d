"""serving: Ray actors that decode with EAGLE-3, the OpenAI-compatible gateway, hot swap.

Knows the core (adaptive_eagle) and the feature store writer; never trains.
"""
