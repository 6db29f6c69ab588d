"""TTT loss == a naive step-by-step reference that drafts exactly as inference does."""

import torch

from adaptive_eagle.draft_head import DraftHeadConfig, DraftKVCache, Eagle3DraftHead, init_weights
from adaptive_eagle.targets import tiny_target
from trainer.ttt import TTTBatch, acceptance_summary, step_valid_mask, ttt_loss


def make_setup(seed=0, dtype=torch.float64, draft_vocab=96, num_experts=1):
    target = tiny_target(seed=seed, dtype=dtype)
    cfg = DraftHeadConfig.from_target(
        target.config, draft_vocab_size=draft_vocab, aux_layer_ids=target.aux_layer_ids, num_experts=num_experts
    )
    torch.manual_seed(seed + 1)
    head = Eagle3DraftHead(cfg).to(dtype)
    init_weights(head, std=0.2)
    head.embed_tokens.weight.data.copy_(target.input_embeddings())
    vocab = torch.randperm(cfg.vocab_size)[:draft_vocab].sort().values
    head.set_draft_vocab(vocab)
    return target, head


def make_batch(target, head, b=3, t=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, target.config.vocab_size, (b, t), generator=g)
    lengths = torch.tensor([t, t - 5, t - 9][:b])
    loss_mask = (torch.rand(b, t, generator=g) < 0.7).long()
    attn = (torch.arange(t)[None] < lengths[:, None]).long()
    feats = target.features(ids, attn)
    w = target.output_embeddings()[head.draft_to_target]
    full = feats.last @ target.output_embeddings().T
    return TTTBatch.build(ids, loss_mask, lengths, feats.aux, lambda need: feats.last[need] @ w.T, full.argmax(-1))


def naive_loss(head, batch, steps=7, decay=0.8):
    """For every start position: prefill the real prefix, then draft a chain step by step."""
    b, t = batch.input_ids.shape
    per_step = [[] for _ in range(steps)]
    for bi in range(b):
        for start in range(t):
            valid_any = [bool(step_valid_mask(batch.loss_mask, batch.lengths, j)[bi, start]) for j in range(steps)]
            if not any(valid_any):
                continue
            cache = DraftKVCache.empty(head.cfg, 1, 4, batch.aux.dtype, "cpu")
            n = start + 1
            ids = batch.input_ids[bi : bi + 1, 1 : n + 1]
            pos = torch.arange(n)[None]
            out = head.step(ids, batch.aux[bi : bi + 1, :n], pos, cache.attend_fn())
            hidden, logits = out.hidden[:, -1:], out.logits[:, -1]
            for j in range(steps):
                if j > 0:
                    tok = batch.input_ids[bi : bi + 1, start + j + 1 : start + j + 2]
                    if tok.numel() == 0:
                        break
                    out = head.step(tok, hidden, torch.tensor([[start + j]]), cache.attend_fn())
                    hidden, logits = out.hidden, out.logits[:, -1]
                if valid_any[j]:
                    p = batch.target_probs[batch.row_index[bi, start + j + 1]]
                    per_step[j].append(-(p * torch.log_softmax(logits[0].float(), -1)).sum())
    return sum(decay**j * torch.stack(v).mean() for j, v in enumerate(per_step) if v)


def test_ttt_loss_matches_naive_reference():
    target, head = make_setup()
    batch = make_batch(target, head)
    fast = ttt_loss(head, batch).loss
    slow = naive_loss(head, batch)
    torch.testing.assert_close(fast, slow.float() if fast.dtype == torch.float32 else slow, rtol=1e-6, atol=1e-6)


def test_ttt_gradients_match_naive_reference():
    target, head = make_setup(seed=3)
    batch = make_batch(target, head, b=2, t=16, seed=3)
    params = head.trainable_parameters()
    g_fast = torch.autograd.grad(ttt_loss(head, batch).loss, params)
    g_slow = torch.autograd.grad(naive_loss(head, batch), params)
    for a, s in zip(g_fast, g_slow):
        torch.testing.assert_close(a, s, rtol=1e-5, atol=1e-7)


def test_moe_head_ttt_runs_and_has_router_loss():
    target, head = make_setup(num_experts=4)
    batch = make_batch(target, head)
    out = ttt_loss(head, batch)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert head.midlayer.mlp.router.weight.grad is not None


def test_acceptance_summary_chain_length():
    s = acceptance_summary([8, 4], [10, 8], [8, 4], [10, 8])
    assert s["alpha"] == [0.8, 0.5]
    assert abs(s["accept_length"] - (1 + 0.8 + 0.4)) < 1e-9


def test_a_batch_with_nothing_to_score_is_a_zero_loss_and_no_update():
    """Rows cut before their first trained token (a prompt longer than max_len) score nothing: ttt_loss gives a
    zero loss without a graph and train_step leaves the parameters as they are."""
    from trainer.step import StepConfig, adamw, train_step

    target, head = make_setup(dtype=torch.float32)
    batch = make_batch(target, head)
    empty = TTTBatch(batch.input_ids, torch.zeros_like(batch.loss_mask), batch.lengths, batch.aux,
                     batch.target_probs[:0], torch.full_like(batch.row_index, -1), batch.target_argmax)
    out = ttt_loss(head, empty)
    assert float(out.loss) == 0.0 and not out.loss.requires_grad and out.step_count == [0] * 7
    before = [p.detach().clone() for p in head.parameters()]
    stats = train_step(head, empty, adamw(head, 1e-3), None, StepConfig(), step=0)
    assert stats.loss == 0.0 and stats.step_count == (0,) * 7 and not stats.skipped
    assert all(torch.equal(a, b) for a, b in zip(before, head.parameters()))
