"""policies: when a new draft head may serve. Pure gate functions over per-request acceptance
samples, the promotion controller (offline gate -> canary -> promote, watch -> roll back), the
promotion log. Never imports torch, the trainer or the servers' internals: it talks to a fleet
through `swap_head(version)` and reads samples.

Modules: samples (RequestSample, the hand-off), config (PolicyConfig), gates (pure decisions),
fleet (the Fleet protocol), canary (the canary's record, its per-request decision and the live-sample
sink; serving calls it), controller (PolicyController and the on-call operations), log
(promotions.jsonl), render (the on-call table), actor (the thin async/Ray shell), cli (the
`promotions`, `rollback`, `pin`, `unpin` commands). Nothing is imported here: `import policies` is free.
"""
