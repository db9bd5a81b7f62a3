"""serve_from_dock: rows pulled as slots free up, written back as they finish, same tokens as `generate`."""

import pytest
import torch

from dockrl.dock.errors import DockTimeoutError
from dockrl.engines.rollout.dock_feed import serve_from_dock
from dockrl.engines.rollout.rollout_engine import RolloutEngine
from dockrl.engines.rollout.sampler import generate
from dockrl.engines.rollout.sampling import SamplingParams
from dockrl.models import ModelArgs, Transformer

GROUP = 3
GROUP_PROMPTS = [[5, 17, 42], [11, 50, 2, 9], [8, 8], [23, 45, 6, 1, 1], [60, 61]]


class FakeDock:
    """DockClient's get/put for one consumer over whole groups of GROUP rows; logs every call."""

    def __init__(self, prompts: list[list[int]], ready_after_gets: int = 0) -> None:
        self.rows = [(g * GROUP + i, torch.tensor(p)) for g, p in enumerate(prompts) for i in range(GROUP)]
        self.served = 0
        self.log: list[tuple[str, list[int]]] = []
        self.responses: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.not_ready_polls = ready_after_gets  # the first polls find nothing ready yet

    def get(self, consumer, columns, count, *, whole_groups, min_count, timeout_s=None):
        assert consumer == "rollout" and columns == ["prompt_ids"] and whole_groups and min_count == GROUP
        if self.served == len(self.rows):
            return None
        if self.not_ready_polls > 0 and self.served > 0:
            self.not_ready_polls -= 1
            if timeout_s == 0.0:
                raise DockTimeoutError("nothing ready")
        count = count // GROUP * GROUP
        taken = self.rows[self.served : self.served + count]
        self.served += len(taken)
        rows = [row for row, _ in taken]
        self.log.append(("get", rows))
        return rows, {"prompt_ids": [prompt for _, prompt in taken]}

    def put(self, producer, rows, batch):
        assert producer == "rollout"
        self.log.append(("put", rows))
        for row, ids, logprobs in zip(rows, batch["response_ids"], batch["rollout_logprobs"]):
            assert row not in self.responses
            self.responses[row] = (ids, logprobs)


def tiny_model() -> Transformer:
    args = ModelArgs(
        family="qwen2",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        attention_bias=True,
        max_position_embeddings=64,
    )
    model = Transformer(args)
    model.init_weights(seed=0, std=0.1)
    return model.eval()


@pytest.mark.parametrize("not_ready_polls", [0, 2])
def test_rows_stream_through_the_engine(not_ready_polls):
    model = tiny_model()
    # Stop tokens end samples early: responses have uneven lengths, so slots free up at different steps.
    params = SamplingParams(max_new_tokens=12, temperature=1.0, stop_token_ids=list(range(0, 64, 8)))
    dock = FakeDock(GROUP_PROMPTS, not_ready_polls)
    engine = RolloutEngine(model, num_slots=2 * GROUP, max_seq_len=32)
    stats = serve_from_dock(
        engine,
        dock,
        consumer="rollout",
        params=params,
        group_size=GROUP,
        groups_per_pull=1,
        row_seed=lambda row: 1000 + row,
    )
    num_rows = GROUP * len(GROUP_PROMPTS)
    assert sorted(dock.responses) == list(range(num_rows))
    assert stats["prefill_prompts"] == len(GROUP_PROMPTS)  # one prefill per group
    assert len(stats["response_lengths"]) == num_rows
    # Only 2 groups fit: the first rows are written back before the last group is even pulled.
    last_get = max(i for i, (kind, _) in enumerate(dock.log) if kind == "get")
    first_put = min(i for i, (kind, _) in enumerate(dock.log) if kind == "put")
    assert first_put < last_get
    # Same tokens as the batch API with the same row seeds, whatever the schedule was.
    prompts = [p for p in GROUP_PROMPTS for _ in range(GROUP)]
    expected = generate(model, prompts, params, [1000 + row for row in range(num_rows)])
    for row, generation in enumerate(expected):
        ids, logprobs = dock.responses[row]
        assert torch.equal(ids, generation.token_ids)
        assert (logprobs - generation.logprobs).abs().max() < 1e-5
    lengths = stats["response_lengths"]
    assert min(lengths) < 12 and max(lengths) == 12 and stats["truncated"] == lengths.count(12)


def test_partial_rollout_continues_cut_rows_under_each_passes_weights():
    """rollout.partial through a real dock (the single-process store behind a socket hub): each pass gives a
    response at most 4 new tokens, cut groups leave the pass and are kept by the reset, the next pass continues
    them with new weights (its seeds, its version), and a row cut max_cuts=2 times runs to the end on its third
    pass. Every final response equals the one `generate` draws under its recorded version schedule: each
    segment from the prompt plus the tokens before it, with that pass's model, seed and budget."""
    from dockrl.dock.central import CentralClient, CentralDock, HubTransport
    from dockrl.dock.transport import ServiceHub
    from dockrl.engines.rollout.dock_feed import Partial

    models = [tiny_model()]
    for seed in (1, 2):  # the weights after updates 1 and 2
        model = tiny_model()
        model.init_weights(seed=seed, std=0.1)
        models.append(model.eval())
    params = SamplingParams(max_new_tokens=12, temperature=1.0, stop_token_ids=list(range(0, 64, 8)))
    partial = Partial(tokens=4, max_cuts=2, max_new_tokens=12)
    hub = ServiceHub(CentralDock())
    client = CentralClient(HubTransport(hub.address, hub.authkey), "driver", get_timeout_s=30)
    client.add_groups([torch.tensor(p) for p in GROUP_PROMPTS], [""] * len(GROUP_PROMPTS), GROUP)
    origin = list(range(GROUP * len(GROUP_PROMPTS)))  # current row -> row of the first pass
    row_at: list[dict[int, int]] = []  # per pass: first-pass row -> its row id in that pass
    final: dict[int, tuple] = {}
    cuts_per_pass = []
    for version, model in enumerate(models):
        row_at.append({o: r for r, o in enumerate(origin)})
        engine = RolloutEngine(model, num_slots=2 * GROUP, max_seq_len=32)
        stats = serve_from_dock(
            engine,
            client,
            consumer="rollout",
            params=params,
            group_size=GROUP,
            groups_per_pull=1,
            row_seed=lambda row, v=version: 1000 * (v + 1) + row,
            version=version,
            partial=partial,
        )
        cuts_per_pass.append(len(stats["interrupted"]))
        cut_groups = sorted({row // GROUP for row in stats["interrupted"]})
        if cut_groups:
            client.drop([g * GROUP + i for g in cut_groups for i in range(GROUP)])
        got = client.get(
            "checkpoint",  # reads every column; its marks go with the reset below
            ["prompt_ids", "response_ids", "rollout_logprobs", "policy_version"],
            64,
            min_count=1,
            timeout_s=5,
        )
        for i, row in enumerate(got[0] if got else []):
            final.setdefault(
                origin[row],
                tuple(
                    got[1][c][i] for c in ("prompt_ids", "response_ids", "rollout_logprobs", "policy_version")
                ),
            )
        kept = client.reset(keep_unfinished="response_ids", served_by="rollout")
        origin = [origin[old] for old in kept]
    assert cuts_per_pass[0] > 0 and cuts_per_pass[1] > 0 and cuts_per_pass[2] == 0  # the third pass ends all
    assert origin == [] and sorted(final) == list(range(GROUP * len(GROUP_PROMPTS)))
    for first_row, (prompt, ids, logprobs, versions) in final.items():
        versions = torch.as_tensor(versions)
        assert versions.tolist() == sorted(versions.tolist())  # versions only grow along a response
        expected_ids, expected_lp, done = [], [], 0
        for version in torch.unique(versions).tolist():
            length = int((versions == version).sum())
            budget = partial.budget(done, version)  # pass `version` follows `version` cuts
            assert length == budget or version == versions[-1]  # cut exactly at the budget
            prefix = torch.as_tensor(prompt).tolist() + torch.as_tensor(ids[:done]).tolist()
            seed = 1000 * (version + 1) + row_at[version][first_row]
            step_params = SamplingParams(**{**params.__dict__, "max_new_tokens": budget})
            (segment,) = generate(models[version], [prefix], step_params, [seed])
            expected_ids.append(segment.token_ids)
            expected_lp.append(segment.logprobs)
            done += length
        assert torch.equal(torch.as_tensor(ids), torch.cat(expected_ids)), first_row
        assert (torch.as_tensor(logprobs) - torch.cat(expected_lp)).abs().max() < 1e-5
    hub.close()


@pytest.mark.parametrize("max_rows", [None, 2 * GROUP])
def test_a_replica_holds_at_most_its_share_of_the_step(max_rows):
    """A small step on several replicas: with its share (RolloutSpec.share_rows) a replica pulls at most that
    many rows at once, and more only as its rows finish, so the others find groups to serve; without it, the
    first to pull takes the whole step (the check sees the difference). Tokens are the same either way: each
    row's seed is its own."""
    model = tiny_model()
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    dock = FakeDock(GROUP_PROMPTS)
    engine = RolloutEngine(model, num_slots=8 * GROUP, max_seq_len=32)
    serve_from_dock(
        engine,
        dock,
        consumer="rollout",
        params=params,
        group_size=GROUP,
        groups_per_pull=4,
        row_seed=lambda row: 1000 + row,
        max_rows=max_rows,
    )
    held, most = 0, 0
    for kind, rows in dock.log:
        held += len(rows) if kind == "get" else -len(rows)
        most = max(most, held)
    # no share: every group of the step at once, none left for another replica
    assert most == (len(GROUP_PROMPTS) * GROUP if max_rows is None else 2 * GROUP)
    assert sorted(dock.responses) == list(range(GROUP * len(GROUP_PROMPTS)))
    prompts = [p for p in GROUP_PROMPTS for _ in range(GROUP)]
    expected = generate(model, prompts, params, [1000 + row for row in range(len(prompts))])
    assert all(torch.equal(dock.responses[row][0], g.token_ids) for row, g in enumerate(expected))


def test_each_replica_s_share_is_an_even_split_of_the_step_s_groups():
    from dockrl.config import TrainConfig, load_config, resolve
    from dockrl.config.specs import specs

    base = ["model.path=/m", "data.train_path=/d.jsonl", "run.steps=1", "rollout.samples_per_prompt=4"]

    def share(*overrides: str) -> int:
        cfg = load_config(TrainConfig, None, [*base, *overrides])
        return specs(cfg, resolve(cfg).plan).rollout.share_rows

    assert share("run.prompts_per_step=4", "actor.dp=2") == 2 * 4  # 16 rows: 8 per rank
    assert share("run.prompts_per_step=5", "actor.dp=2") == 3 * 4  # rounded up: every group has a taker
    assert share("run.prompts_per_step=4", "actor.dp=2", "actor.tp=2", "rollout.tp=2") == 2 * 4
    assert share("run.prompts_per_step=4", "actor.dp=2", "rollout.tp=2") == 4 * 4  # one replica
    assert share("run.prompts_per_step=6", "rollout.placement=separate", "rollout.replicas=3") == 2 * 4
