"""bench/serve_batching.py: a small sweep through the real gateway and the openai client, over the SGLang stand-in:
the serialised arm never has two requests at SGLang at once, the batched arm has every client's request there."""

from bench.serve_batching import sweep


def test_a_small_sweep_runs_both_arms_without_failures_and_only_the_batched_one_batches(tmp_path):
    result = sweep([1, 4], per_level=8, max_tokens=16, step_s=0.05, batch_cost=0.0, tmp=tmp_path)
    for clients, level in result["levels"].items():
        assert level["serialised"]["failed"] == level["batched"]["failed"] == 0
        assert level["serialised"]["requests"] == level["batched"]["requests"] == 8
        assert level["serialised"]["peak_running"] == 1
        assert 1 < level["batched"]["peak_running"] <= int(clients) or int(clients) == 1
        assert level["throughput_ratio"] is not None
