"""policies: when a new draft head may serve. Pure gate functions over per-request acceptance
samples, the promotion controller (offline gate -> canary -> promote, watch -> roll back), the
promotion log. Never imports torch, the trainer or the servers' internals: it talks to a fleet
through `swap_head(version)` and reads samples."""
