"""adaptive_eagle: the EAGLE-3 core (targets, draft head, trees, verification, checkpoints, CLI).

No I/O services live here; serving, feature_store, trainer and policies build on it.
"""

__version__ = "0.1.0"
