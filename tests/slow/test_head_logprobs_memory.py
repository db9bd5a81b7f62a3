"""The fused head's memory at a real vocabulary (kept out of `make test`: a Qwen-sized head pass)."""

from dockrl.bench.logprob_memory import measure


def test_log_probs_at_qwen_vocabulary_stay_under_a_gigabyte():
    """Qwen2.5's head (V = 151,936, H = 896): one forward and backward pass of 512 tokens holds under 1 GiB above
    its inputs and the weight's gradient (the chunks' buffers only; whole fp32 logits with their gradient
    would be 2 x 297 MiB at this size and 2 x 4.7 GiB at 8k tokens). `dockrl bench logprobs` measures 8k."""
    row = measure("fused", tokens=512, vocab=151936, hidden=896)
    assert row["peak_mb"] < 1024, row
