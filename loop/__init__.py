"""loop: the composition of the adaptive loop, one room above its parts. It starts and wires serving
(server replicas, the gateway), the feature store, the near-line trainer and the promotion policy, which
are peers that meet only through the store and the head registry.

Owns: the stack config and its consistency check (config.py, check.py), starting and stopping the parts
in order (stack.py), handing the trainer's candidates to the policy (candidates.py), the gateway's load
signal the trainer yields to (load_signal.py), the loop's own metrics (metrics.py) and `adaptive-eagle up`
(cli.py). Must not touch: what each part does; only adaptive_eagle_cli imports this package.
"""
