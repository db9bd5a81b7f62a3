"""Multi-turn rollout: tool-call parsing, the built-in tools and their sandbox, observation tokens as the chat
template's delta, and serve_multi_turn through a fake dock (token in, token out; masks; limits; failures)."""

import copy
import math
import time

import pytest
import torch

from dockrl.dock.errors import DockTimeoutError
from dockrl.engines.rollout.multi_turn import (
    ChatDelta,
    TurnLimits,
    final_turn,
    run_trajectories,
    serve_multi_turn,
    turn_runs,
)
from dockrl.engines.rollout.rollout_engine import Completion, Generation, RolloutEngine
from dockrl.engines.rollout.sampling import SamplingParams
from dockrl.envs import sandbox
from dockrl.envs.base import Observation
from dockrl.envs.host import EnvHost, LocalEnvs
from dockrl.envs.tool_calls import ToolCall, format_tool_calls, parse_tool_calls, text_outside_calls
from dockrl.envs.tool_env import ToolEnvironment
from dockrl.envs.tools import Calculator, Python, ToolError
from dockrl.models.hf import load_model
from dockrl.models.tokenizer import Tokenizer

GROUP = 2


# ---- tool calls and tools ------------------------------------------------------------------------------------


def test_qwen_tool_calls_parse_and_malformed_ones_are_errors():
    text = (
        'Let me compute.<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'
        '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
    )
    parsed = parse_tool_calls(text, "qwen2")
    assert [(c.name, c.arguments) for c in parsed.calls] == [
        ("calculator", {"expression": "12*34"}),
        ("python", {"code": "print(1)"}),  # arguments given as a JSON string
    ]
    assert parsed.errors == []
    assert parse_tool_calls("The answer is 408.", "qwen3").calls == []
    bad = parse_tool_calls(
        '<tool_call>{"name": calculator}</tool_call><tool_call>{"arguments": {}}</tool_call>', "qwen2"
    )
    assert bad.calls == [] and len(bad.errors) == 2 and "not valid JSON" in bad.errors[0]
    assert "not closed" in parse_tool_calls('<tool_call>{"name": "x"', "qwen2").errors[0]


def test_llama_tool_calls_parse():
    parsed = parse_tool_calls(
        '<|python_tag|>{"name": "calculator", "parameters": {"expression": "2+2"}}', "llama"
    )
    assert [(c.name, c.arguments) for c in parsed.calls] == [("calculator", {"expression": "2+2"})]
    two = parse_tool_calls(
        '{"name": "a", "parameters": {"s": "x;y"}}; {"name": "b", "parameters": {}}', "llama"
    )
    assert [c.name for c in two.calls] == ["a", "b"] and two.calls[0].arguments == {"s": "x;y"}
    assert parse_tool_calls("Just text.", "llama").calls == []
    assert parse_tool_calls("<|python_tag|>print(1)", "llama").errors


def test_tool_calls_written_in_a_familys_format_parse_back():
    calls = [
        ToolCall("calculator", {"expression": "12*34"}),
        ToolCall("note", {"text": "caf\u00e9", "n": [1]}),
    ]
    qwen = format_tool_calls(calls, "qwen2")
    # Qwen2.5's chat template lays an assistant's tool_calls out so; its tojson keeps non-ASCII characters
    assert qwen == (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "note", "arguments": {"text": "caf\u00e9", "n": [1]}}\n</tool_call>'
    )
    llama = format_tool_calls(calls, "llama")
    assert llama == (
        '{"name": "calculator", "parameters": {"expression": "12*34"}}; '
        '{"name": "note", "parameters": {"text": "caf\u00e9", "n": [1]}}'
    )
    for family, text in (("qwen2", f"Let me see.\n{qwen}"), ("qwen3", qwen), ("llama", llama)):
        parsed = parse_tool_calls(text, family)
        assert parsed.calls == calls and parsed.errors == [], family
    assert text_outside_calls(f"Let me see.\n{qwen}", "qwen2") == "Let me see."
    assert text_outside_calls(llama, "llama") == "" and text_outside_calls(" Hi. ", "llama") == "Hi."
    with pytest.raises(ValueError, match="no tool-call format for model family 'qwen3_moe'"):
        format_tool_calls(calls, "qwen3_moe")


def test_calculator_is_exact_and_refuses_what_is_not_arithmetic():
    calc = Calculator()
    assert calc.run({"expression": "123*456"}) == "56088"
    assert calc.run({"expression": "(7+8)/3"}) == "5"
    assert calc.run({"expression": "1/4"}) == "0.25"
    assert calc.run({"expression": "987654321*123456789"}) == str(987654321 * 123456789)
    for expression, message in [
        ("__import__('os')", "unsupported"),
        ("1/0", "division by zero"),
        ("2**100000", "exponents"),
        ("1+", "cannot parse"),
        ("(9**999)**999", "more than 4000 digits"),  # refused before it is computed
        ("10**999*10**999*10**999*10**999*10**999", "more than 4000 digits"),
    ]:
        with pytest.raises(ToolError, match=message):
            calc.run({"expression": expression})
    # within the bound, past what str() of an int allows by default (4300 digits) is never reached, and past
    # float's range a quotient is still answered, to 12 digits
    assert len(calc.run({"expression": "9**999*9**999*9**999"})) == 2860
    assert calc.run({"expression": "10**400/3"}) == "3.33333333333E+399"


@pytest.mark.skipif(sandbox.bwrap() is None, reason="bubblewrap is installed by `make test`")
def test_python_tool_runs_code_without_network_within_limits():
    tool = Python(cpu_s=5, memory_mb=256)
    assert tool.run({"code": "print(sum(range(10)))"}, timeout_s=30).strip() == "45"
    refused = tool.run(
        {"code": "import socket\ntry:\n    socket.socket()\nexcept OSError as e:\n    print(e)"}, 30
    )
    assert "network access is disabled" in refused
    memory = tool.run({"code": "x = bytearray(1024 ** 3)"}, timeout_s=30)
    assert "MemoryError" in memory
    # the sandbox's other promises are attacked in tests/distributed/test_sandbox.py


def test_tool_environment_answers_calls_and_errors():
    env = ToolEnvironment(["calculator"], family="qwen2")
    assert env.reset({"prompt": "What is 12*34?"}).as_messages() == [
        {"role": "user", "content": "What is 12*34?"}
    ]
    obs = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>')
    assert obs.as_messages() == [{"role": "tool", "content": "408"}] and not obs.done
    assert obs.info == {"tool_calls": 1, "tool_errors": 0, "timeouts": 0}
    obs = env.step('<tool_call>{"name": "search", "arguments": {}}</tool_call><tool_call>oops</tool_call>')
    assert obs.info["tool_errors"] == 2 and all(m["content"].startswith("Error:") for m in obs.as_messages())
    assert env.step("408").done


# ---- observation tokens ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from dockrl.models.tiny import make_tiny

    path = make_tiny(
        tmp_path_factory.mktemp("mt") / "model", family="qwen2", hidden_size=64, num_layers=2, seed=0
    )
    return path, Tokenizer.from_dir(path)


def test_observation_tokens_are_the_templates_delta_with_the_turn_close(tiny):
    _, tokenizer = tiny
    tools = [Calculator.schema]
    delta = ChatDelta(tokenizer, tools)
    history = [{"role": "user", "content": "What is 12*34?"}]
    assistant = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'
    new = [{"role": "tool", "content": "408"}]
    expected = "<|im_end|>\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    # Stopped at <|im_end|>: the observation starts with the newline the template writes after it.
    ids, append_only = delta.observation(history, assistant, assistant + "<|im_end|>", new)
    assert append_only and tokenizer.decode(ids, skip_special_tokens=False) == expected.removeprefix(
        "<|im_end|>"
    )
    # Cut at the turn's token limit: the observation closes the turn first.
    ids, _ = delta.observation(history, assistant, assistant, new)
    assert tokenizer.decode(ids, skip_special_tokens=False) == expected
    # The prompt, the sampled turn and the observation decode to what a fresh render of the conversation gives.
    prompt = tokenizer.apply_chat_template(history, add_generation_prompt=True, tools=tools)
    fresh = tokenizer.apply_chat_template(
        [*history, {"role": "assistant", "content": assistant}, *new], tools=tools
    )
    assert prompt + assistant + expected == fresh


def test_renders_made_before_are_reused_and_give_the_same_tokens(tiny):
    """Two samples of one prompt, two observations each: the conversation before a turn was rendered before
    (the prompt's by the other sample, a later turn's as the previous observation's last render), so 9
    renders are made where 12 were asked; every observation's tokens are those of a delta that keeps none."""
    _, tokenizer = tiny
    tools = [Calculator.schema]
    kept, fresh = ChatDelta(tokenizer, tools), ChatDelta(tokenizer, tools)
    fresh.RENDERS_KEPT = 0
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
    for sample, expressions in enumerate((["12*34", "408+1"], ["12*35", "420-2"])):
        history = [{"role": "user", "content": "What is 12*34?"}]
        for turn, expression in enumerate(expressions):
            assistant, new = call % expression, [{"role": "tool", "content": f"{sample}{turn}"}]
            args = (list(history), assistant, assistant + "<|im_end|>", new)
            assert kept.observation(*args) == fresh.observation(*args)
            history += [{"role": "assistant", "content": assistant}, *new]
    assert (kept.renders, fresh.renders) == (9, 12)


def test_a_template_that_rewrites_history_is_flagged_and_the_trajectory_keeps_its_own(tiny):
    """A Qwen3-like template that drops earlier <think> blocks is not append-only: the turn is still closed and
    the new messages rendered, and the mismatch is reported."""
    _, tokenizer = tiny
    stripping = (
        "{% for m in messages %}{% set c = m['content'] %}"
        "{% if m['role'] == 'assistant' and not loop.last %}{% set c = c.split('</think>')[-1] %}{% endif %}"
        "{{ '<|im_start|>' + ('user' if m['role'] == 'tool' else m['role']) + '\\n' + c + '<|im_end|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    other = copy.copy(tokenizer)
    other.chat_template = stripping
    delta = ChatDelta(other, [])
    assistant = "<think>hmm</think>call"
    ids, append_only = delta.observation(
        [{"role": "user", "content": "q"}],
        assistant,
        assistant + "<|im_end|>",
        [{"role": "tool", "content": "5"}],
    )
    assert not append_only
    assert (
        other.decode(ids, skip_special_tokens=False)
        == "\n<|im_start|>user\n5<|im_end|>\n<|im_start|>assistant\n"
    )


def test_final_turn_is_the_last_run_of_policy_tokens():
    assert final_turn([1, 2, 3, 4, 5, 6], [1, 1, 0, 0, 1, 1]) == [5, 6]
    assert final_turn([1, 2, 3], [1, 0, 0]) == [1]
    assert final_turn([7], [0]) == []


# ---- serve_multi_turn ------------------------------------------------------------------------------------------


class FakeDock:
    """get/put of the rollout stage over whole groups, with env_row; stores what is put."""

    def __init__(self, prompts: list[list[int]], rows: list[dict]):
        self.rows = [
            (g * GROUP + i, torch.tensor(p), r)
            for g, (p, r) in enumerate(zip(prompts, rows))
            for i in range(GROUP)
        ]
        self.served = 0
        self.out: dict[int, dict] = {}

    def get(self, consumer, columns, count, *, whole_groups, min_count, timeout_s=None):
        assert columns == ["prompt_ids", "env_row"] and whole_groups and min_count == GROUP
        if self.served == len(self.rows):
            return None
        taken = self.rows[self.served : self.served + count // GROUP * GROUP]
        if not taken:
            raise DockTimeoutError("nothing ready")
        self.served += len(taken)
        return [r for r, _, _ in taken], {
            "prompt_ids": [p for _, p, _ in taken],
            "env_row": [e for _, _, e in taken],
        }

    def put(self, producer, rows, batch):
        for i, row in enumerate(rows):
            assert row not in self.out
            self.out[row] = {k: v[i] for k, v in batch.items()}


class Scripted:
    """Answers `turns - 1` assistant messages with a tool message, then ends with reward 1; records them."""

    tools = [Calculator.schema]
    seen: dict[str, list[str]] = {}

    def __init__(self, turns: int = 3, fail_on: str | None = None, sleep_s: float = 0.0):
        self.turns, self.fail_on, self.sleep_s, self.t = turns, fail_on, sleep_s, 0

    def reset(self, row):
        self.key = row["prompt"]
        Scripted.seen.setdefault(self.key, [])
        return Observation(messages=[{"role": "user", "content": row["prompt"]}])

    def step(self, message):
        self.t += 1
        Scripted.seen[self.key].append(message)
        if self.fail_on is not None and self.fail_on in self.key:
            raise RuntimeError("the environment broke")
        time.sleep(self.sleep_s)
        if self.t >= self.turns:
            return Observation(done=True, reward=1.0)
        return Observation(messages=[{"role": "tool", "content": f"result {self.t}"}], info={"tool_calls": 1})


def _serve(tiny, prompts, make_env, limits, max_new_tokens=6, max_seq_len=512, keep_kv=True):
    path, tokenizer = tiny
    model = load_model(path).eval()
    engine = RolloutEngine(
        model, num_slots=8, max_seq_len=max_seq_len, pad_token_id=0, detokenize=tokenizer.decode
    )
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tools=Scripted.tools
        )
        for p in prompts
    ]
    dock = FakeDock([tokenizer.encode(t) for t in texts], [{"prompt": p, "label": None} for p in prompts])
    sampled: dict[int, list] = {}
    step = engine.step

    def recording_step():
        done = step()
        for c in done:
            sampled.setdefault(c.tag[c.sample], []).append(c.generation)
        return done

    engine.step = recording_step
    eos = tokenizer.encode("<|im_end|>")
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, stop_token_ids=eos)
    stats = serve_multi_turn(
        engine,
        dock,
        consumer="rollout",
        params=params,
        group_size=GROUP,
        groups_per_pull=2,
        row_seed=lambda row: 1000 + row,
        envs=LocalEnvs(EnvHost(make_env, concurrency=3)),
        delta=ChatDelta(tokenizer, Scripted.tools),
        system_prompt=None,
        limits=limits,
        version=0,
        keep_kv=keep_kv,
    )
    return dock, sampled, stats, tokenizer


LIMITS = TurnLimits(max_turns=4, max_tool_calls=8, max_response_tokens=200, call_timeout_s=30)


def test_trajectories_are_the_sampled_tokens_and_the_template_delta(tiny):
    prompts = ["What is 1+2?", "What is 9-4?", "What is 6+6?"]
    Scripted.seen = {}
    dock, sampled, stats, tokenizer = _serve(tiny, prompts, lambda: Scripted(turns=3), LIMITS)
    assert sorted(dock.out) == list(range(len(prompts) * GROUP))
    assert stats["env"]["turns"] == 3 * len(dock.out) and stats["env"]["truncated"] == 0
    for row, out in dock.out.items():
        ids, mask, logprobs = out["response_ids"].tolist(), out["loss_mask"].tolist(), out["rollout_logprobs"]
        assert len(ids) == len(mask) == len(logprobs) == len(out["policy_version"])
        assert out["env_reward"] == 1.0 and out["env_failed"] == 0.0
        # Every turn's sampled tokens sit, in order, exactly where loss_mask is 1, with their log-probs.
        runs, start = [], None
        for i, m in enumerate([*mask, 0.0]):
            if m == 1.0 and start is None:
                start = i
            elif m == 0.0 and start is not None:
                runs.append((start, i))
                start = None
        turns = sampled[row]
        assert len(runs) == len(turns) == 3
        for (a, b), gen in zip(runs, turns):
            assert ids[a:b] == gen.token_ids.tolist()
            assert torch.equal(logprobs[a:b], gen.logprobs)
        assert all(logprobs[i] == 0.0 for i, m in enumerate(mask) if m == 0.0)
        # Decoded whole, the trajectory is the fresh render of its conversation (nothing dropped at a turn
        # boundary): the environment saw each turn's message.
        prompt_ids = dock.rows[row][1].tolist()
        text = tokenizer.decode(prompt_ids + ids, skip_special_tokens=False)
        messages = [{"role": "user", "content": dock.rows[row][2]["prompt"]}]
        for t, gen in enumerate(turns):
            body = gen.token_ids.tolist()
            body = body[:-1] if body[-1] in tokenizer.encode("<|im_end|>") else body
            messages.append(
                {"role": "assistant", "content": tokenizer.decode(body, skip_special_tokens=False)}
            )
            if t < 2:
                messages.append({"role": "tool", "content": f"result {t + 1}"})
        fresh = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tools=Scripted.tools)
        assert fresh.startswith(text) and fresh[len(text) :] in ("\n", "<|im_end|>\n")


def test_a_trajectory_is_cut_at_its_limits(tiny):
    Scripted.seen = {}
    dock, _, stats, _ = _serve(tiny, ["What is 1+2?"], lambda: Scripted(turns=10), TurnLimits(2, 8, 200, 30))
    assert stats["env"]["turns"] == 2 * GROUP and stats["env"]["truncated"] == GROUP
    assert all(math.isnan(out["env_reward"]) for out in dock.out.values())
    # The token budget: trajectories end when the next observation would not leave room for a turn.
    dock, _, stats, _ = _serve(tiny, ["What is 1+2?"], lambda: Scripted(turns=10), TurnLimits(10, 8, 60, 30))
    assert stats["env"]["truncated"] == GROUP and all(
        len(out["response_ids"]) < 60 for out in dock.out.values()
    )


def test_a_trajectory_ends_where_the_engines_cache_ends(tiny):
    """A trajectory budget past what the engine holds per sequence (the model's positions): turns are cut to the
    room left and the trajectory ends truncated there, never a request the engine refuses."""
    Scripted.seen = {}
    _, tokenizer = tiny
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 1+2?"}], add_generation_prompt=True, tools=Scripted.tools
    )
    cache = len(tokenizer.encode(prompt)) + 40
    dock, _, stats, _ = _serve(
        tiny, ["What is 1+2?"], lambda: Scripted(turns=10), TurnLimits(10, 8, 1000, 30), max_seq_len=cache
    )
    assert stats["env"]["truncated"] == GROUP
    assert all(
        len(out["response_ids"]) < 40 for out in dock.out.values()
    )  # prompt + response within the cache


def test_a_failing_or_slow_environment_ends_its_trajectory_only(tiny):
    Scripted.seen = {}
    dock, _, stats, _ = _serve(
        tiny, ["What is 1+2?", "broken 3+4"], lambda: Scripted(turns=2, fail_on="broken"), LIMITS
    )
    failed = {row for row, out in dock.out.items() if out["env_failed"] == 1.0}
    assert failed == {2, 3} and stats["env"]["failed"] == 2
    assert all(dock.out[row]["env_reward"] == 1.0 for row in (0, 1))
    slow = TurnLimits(4, 8, 200, call_timeout_s=0.5)
    dock, _, stats, _ = _serve(tiny, ["What is 1+2?"], lambda: Scripted(turns=3, sleep_s=3.0), slow)
    assert stats["env"]["timeouts"] == GROUP and stats["env"]["truncated"] == GROUP


def test_environment_seconds_count_the_calls_and_the_wait(tiny):
    # GROUP trajectories, each with 2 calls that sleep 0.2 s and finish their turn (turns=2): env_s sums the
    # calls' own time (>= 2 * GROUP * 0.2 s: sleep lasts at least its argument, timed in the call's thread).
    # Every decoded turn is followed by a call, so after the last call is submitted nothing decodes and the loop
    # waits for it: 0.2 s, less the loop's own work between its waits (microseconds; 0.1 s leaves room).
    Scripted.seen = {}
    _, _, stats, _ = _serve(tiny, ["What is 1+2?"], lambda: Scripted(turns=2, sleep_s=0.2), LIMITS)
    assert stats["env"]["env_s"] >= 2 * GROUP * 0.2
    assert stats["env"]["env_wait_s"] >= 0.1


# ---- masks in the update ---------------------------------------------------------------------------------------


def _masked_update(path: str, advantages: list[torch.Tensor], refs: list[torch.Tensor], batch: dict):
    from dockrl.config.schema import AlgoConfig, OptimConfig
    from dockrl.config.step_plan import loss_plan
    from dockrl.engines.train.policy_update import policy_update
    from dockrl.engines.train.train_engine import TrainEngine

    torch.manual_seed(0)
    engine = TrainEngine(path, device="cpu", precision="fp32", optim=OptimConfig(lr=1e-3, grad_clip=0.0))
    rows = {**batch, "advantages": advantages, "ref_logprobs": refs}
    from dockrl.engines.train.batch import make_micro_batch

    with torch.no_grad():
        mb = make_micro_batch(rows["prompt_ids"], rows["response_ids"], pad_token_id=0)
        logp, entropy = (x.double() for x in engine.token_stats(mb, 1.0))
    metrics = policy_update(
        engine,
        rows,
        list(range(len(rows["prompt_ids"]))),
        ["advantages", "ref_logprobs"],
        loss_plan(AlgoConfig(name="grpo", kl_coef=0.1)),
        temperature=1.0,
        micro_batch_size=8,
        pad_token_id=0,
        world_size=1,
    )
    weights = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    return metrics, logp, entropy, mb, weights


def test_observation_tokens_leave_the_loss_the_kl_the_entropy_and_the_normaliser(tiny):
    """GRPO on-policy (ratio 1): pg_loss = -sum(A m) / sum(m), kl = sum(k3 m) / sum(m), entropy = sum(H m) /
    sum(m) with m the loss mask, computed by hand in fp64 from the same forward; the update's fp32 sums differ
    by at most n u sum|terms| / sum(m) (n terms, u = 2^-24). Changing advantages and reference log-probs where
    m = 0 changes nothing, bit for bit."""
    path, _ = tiny
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 200, (5,), generator=g), torch.randint(3, 200, (3,), generator=g)]
    responses = [torch.randint(3, 200, (9,), generator=g), torch.randint(3, 200, (6,), generator=g)]
    masks = [torch.tensor([1, 1, 1, 0, 0, 0, 1, 1, 1.0]), torch.tensor([1, 1, 0, 0, 1, 1.0])]
    batch = {"prompt_ids": prompts, "response_ids": responses, "loss_mask": masks}
    advantages = [torch.full((9,), 0.7), torch.full((6,), -1.3)]
    refs = [torch.randn(9, generator=g) - 5, torch.randn(6, generator=g) - 5]
    metrics, logp, entropy, mb, weights = _masked_update(str(path), advantages, refs, batch)
    grid = torch.zeros_like(logp)
    adv_grid, ref_grid = torch.zeros_like(logp), torch.zeros_like(logp)
    for i, (start, length) in enumerate(zip(mb.starts, mb.lengths)):
        grid[i, start : start + length] = masks[i].double()
        adv_grid[i, start : start + length] = advantages[i].double()
        ref_grid[i, start : start + length] = refs[i].double()
    count = grid.sum()
    d = ref_grid - logp
    k3 = (d.exp() - d - 1) * grid
    expected = {
        "pg_loss": (-(adv_grid * grid).sum() / count, (adv_grid.abs() * grid).sum()),
        "kl": (k3.sum() / count, k3.abs().sum()),
        "entropy": ((entropy * grid).sum() / count, (entropy.abs() * grid).sum()),
    }
    n = int(grid.numel())
    for key, (value, magnitude) in expected.items():
        assert abs(metrics[key] - float(value)) <= n * 2.0**-24 * float(magnitude) / float(count), key
    # What lies under a zero mask does not matter.
    changed_adv = [a.clone() for a in advantages]
    changed_ref = [r.clone() for r in refs]
    for a, r, m in zip(changed_adv, changed_ref, masks):
        a[m == 0] = 100.0
        r[m == 0] = 3.0
    again, _, _, _, weights_again = _masked_update(str(path), changed_adv, changed_ref, batch)
    assert again == metrics
    assert all(torch.equal(weights[k], weights_again[k]) for k in weights)


def test_trajectories_repeat_exactly_with_a_deterministic_environment(tiny):
    """Every turn's seed comes from the row's seed and the turn number, so serving the same rows again (what a
    regenerated step does) gives the same tokens and masks, bit for bit, whatever order tools return in. The
    log-probs are equal up to the rounding of batches composed differently (the forward's widest dot product,
    192 = 3 x 64 terms, K u relative on log-probs of magnitude |logp|)."""
    outs = []
    for workers_sleep in (0.0, 0.01):  # another timing of the environment's answers
        Scripted.seen = {}
        dock, _, _, _ = _serve(
            tiny,
            ["What is 1+2?", "What is 9-4?"],
            lambda s=workers_sleep: Scripted(turns=3, sleep_s=s),
            LIMITS,
        )
        outs.append(dock.out)
    assert outs[0].keys() == outs[1].keys()
    for row in outs[0]:
        for key in ("response_ids", "loss_mask"):
            assert torch.equal(outs[0][row][key], outs[1][row][key]), (row, key)
        a, b = outs[0][row]["rollout_logprobs"], outs[1][row]["rollout_logprobs"]
        assert ((a - b).abs() <= 192 * 2.0**-24 * a.abs().clamp(min=1.0)).all(), row


def test_kv_kept_across_turns_gives_the_re_prefill_paths_trajectories(tiny):
    """A trajectory's KV kept while its environment runs: each later turn prefills only its last sampled token
    and the observation, and the trajectories are the re-prefill path's token for token. The log-probs differ by
    fp32 reassociation only (the kept keys of sampled tokens came from decode steps, a re-prefill computes them in
    one causal pass): the widest sum is attention over at most max_seq_len = 512 positions, n u relative per
    layer, compounded over the 2 layers and the LM head: 4 x 512 u x max(1, |logp|)."""
    prompts = ["What is 1+2?", "What is 9-4?"]
    runs = {}
    for keep in (False, True):
        Scripted.seen = {}
        dock, _, stats, _ = _serve(tiny, prompts, lambda: Scripted(turns=3), LIMITS, keep_kv=keep)
        runs[keep] = dock.out, stats["env"]
    (off, off_env), (on, on_env) = runs[False], runs[True]
    assert on_env["kv_reused_tokens"] > 0 and off_env["kv_reused_tokens"] == 0
    # Every position of every turn's prompt is prefilled, found kept, or found prefilled for a request admitted
    # with the same prompt (the samples' first turn; later turns whose histories coincide, when they happen to
    # be admitted together: that depends on when the environment answers, so the shares vary, the sum does not).
    positions = [
        env["prefill_tokens"] + env["kv_reused_tokens"] + env["shared_prompt_tokens"]
        for env in (on_env, off_env)
    ]
    assert positions[0] == positions[1]
    assert on.keys() == off.keys()
    for row in on:
        for key in ("response_ids", "loss_mask"):
            assert torch.equal(on[row][key], off[row][key]), (row, key)
        a, b = on[row]["rollout_logprobs"], off[row]["rollout_logprobs"]
        assert ((a - b).abs() <= 4 * 512 * 2.0**-24 * b.abs().clamp(min=1.0)).all(), row


def test_sft_trains_on_the_assistant_turns_of_a_tool_conversation_in_the_rollouts_layout(tiny):
    """A tool-use conversation for `dockrl sft`: every assistant turn (with its stop token) is trained on, the
    tool turn is not, and the tokens decode to the conversation's fresh render (what rollout produces)."""
    from dockrl.data.synthetic import tool_call_text
    from dockrl.recipes.sft import conversation_example

    _, tokenizer = tiny
    messages = [
        {"role": "user", "content": "What is 123*456?"},
        {"role": "assistant", "content": tool_call_text("123*456")},
        {"role": "tool", "content": "56088"},
        {"role": "assistant", "content": "56088"},
    ]
    tools = [Calculator.schema]
    prompt, ids, mask = conversation_example(tokenizer, messages, tools, None)
    assert len(ids) == len(mask)
    eos = tokenizer.eos_token_id
    trained = [t for t, m in zip(ids, mask) if m == 1.0]
    expected = tokenizer.encode(messages[1]["content"]) + [eos] + tokenizer.encode("56088") + [eos]
    assert trained == expected
    text = tokenizer.decode(prompt + ids, skip_special_tokens=False)
    fresh = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tools=tools)
    assert fresh == text + "\n"
    # The teacher's conversations parse back into the call the tool environment runs.
    call = parse_tool_calls(messages[1]["content"], "qwen2").calls
    assert [(c.name, c.arguments) for c in call] == [("calculator", {"expression": "123*456"})]


class ScriptedPolicy:
    """The policy's side of a trajectory, scripted: each request of a row gets that row's next message (real
    tokens of the tiny tokenizer), log-prob -0.5 per token. What is under test is everything else: the tool
    environment, its calls, the observation tokens and their masks."""

    def __init__(self, scripts: dict[int, list[list[int]]]):
        self.scripts, self.pending, self.stats = scripts, [], {}

    def add(self, request):
        row = request.tag[0]
        ids = self.scripts[row].pop(0)
        self.pending.append(
            Completion(request.tag, 0, Generation(torch.tensor(ids), torch.full((len(ids),), -0.5), "stop"))
        )

    def step(self):
        done, self.pending = self.pending, []
        return done

    def num_free_slots(self):
        return 8

    def has_work(self):
        return bool(self.pending)


def test_a_real_tool_call_and_its_observation_masked_out_of_the_update(tiny):
    """A policy that calls the calculator (Qwen format) and then answers: the built-in tool environment runs the
    call, its answer comes back as observation tokens (loss_mask 0, log-prob 0) between the two turns, and the
    update does not see them: changing advantages and reference log-probs under them changes nothing, while
    changing them under a sampled token does."""
    path, tokenizer = tiny
    eos = tokenizer.encode("<|im_end|>")
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "347*829"}}</tool_call>'
    scripts = {r: [tokenizer.encode(call) + eos, tokenizer.encode("287663") + eos] for r in range(2)}
    env = ToolEnvironment(tools=["calculator"], family="qwen2")
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 347*829?"}], add_generation_prompt=True, tools=env.tools
    )
    prompts = [tokenizer.encode(prompt)] * 2
    outs, stats = run_trajectories(
        ScriptedPolicy(scripts),
        prompts,
        [{"prompt": "What is 347*829?"}] * 2,
        params=SamplingParams(max_new_tokens=64, temperature=1.0, stop_token_ids=eos),
        groups_per_pull=2,
        row_seed=lambda row: row,
        envs=LocalEnvs(EnvHost(lambda: ToolEnvironment(tools=["calculator"], family="qwen2"), 2)),
        delta=ChatDelta(tokenizer, env.tools),
        system_prompt=None,
        limits=TurnLimits(max_turns=3, max_tool_calls=2, max_response_tokens=200, call_timeout_s=10),
    )
    assert stats["env"]["tool_calls"] == 2 and stats["env"]["tool_errors"] == 0 and stats["env"]["turns"] == 4
    out = outs[0]
    runs = turn_runs(out["response_ids"], out["loss_mask"])
    assert [sampled for sampled, _ in runs] == [True, False, True]
    observation = tokenizer.decode(runs[1][1], skip_special_tokens=False)
    assert "287663" in observation  # the calculator's answer, rendered by the chat template
    mask = out["loss_mask"]
    assert torch.all(out["rollout_logprobs"][mask == 0] == 0) and torch.all(
        out["rollout_logprobs"][mask == 1] == -0.5
    )
    # the update
    batch = {
        "prompt_ids": [torch.tensor(p) for p in prompts],
        "response_ids": [o["response_ids"] for o in outs],
        "loss_mask": [o["loss_mask"] for o in outs],
    }
    n = [len(o["response_ids"]) for o in outs]
    advantages = [torch.full((k,), 0.5) for k in n]
    refs = [torch.full((k,), -4.0) for k in n]
    metrics, _, _, _, weights = _masked_update(str(path), advantages, refs, batch)
    hidden_adv = [a.clone() for a in advantages]
    hidden_ref = [r.clone() for r in refs]
    for a, r, o in zip(hidden_adv, hidden_ref, outs):
        a[o["loss_mask"] == 0] = 100.0
        r[o["loss_mask"] == 0] = 3.0
    again, _, _, _, weights_again = _masked_update(str(path), hidden_adv, hidden_ref, batch)
    assert again == metrics and all(torch.equal(weights[k], weights_again[k]) for k in weights)
    seen = [a.clone() for a in advantages]
    seen[0][0] = 100.0  # the first sampled token
    changed, _, _, _, _ = _masked_update(str(path), seen, refs, batch)
    assert changed["pg_loss"] != metrics["pg_loss"]
