"""Context parallelism beyond the actor's token_stats: the critic (critic.cp), the teacher (distill.cp) and the
student's top-k distillation scoring (support_stats) with a sequence split over cp = 2 ranks equal one process.

One spawn of 2 gloo processes, (dp, cp) = (1, 2):
- the critic: a CriticWorker (setup on the (1, 2) mesh, its dock reached through the cp head) takes its values
  stage and one update; its values, advantages, returns, metrics and gradients against a single-process worker;
  its checkpoint (critic.cp is a layout setting) resumes in one process bit for bit;
- the teacher: TrainEngine.logprobs and top_k_logprobs (what TeacherWorker._score calls) on a frozen engine;
- the student: one policy update of opd with distill.top_k (engine.support_stats over the split sequence).

Rows are 15 to 45 tokens (test_cp_equivalence.make_rows), so both ranks hold response tokens of every row and
the ring's whole, diagonal and skipped chunk pairs all occur. Bounds, as in test_cp_equivalence: the split only
reorders fp32 sums (attention's softmax per key block merged by log-sum-exp; key/value gradients summed over 2
ring steps; FSDP2 averaging over 2 ranks). A value or log-prob is a function of ~10^3 products here (tokens x
heads), so it moves by < 1e3 eps_fp32 ~ 1.2e-4 of its scale (atol = VALUE_ATOL_OF_SCALE x the largest |value|);
the O(1) metric sums by 1e-4 relative; gradients by helpers.GRAD_RTOL / GRAD_ATOL_OF_SCALE. A value or log-prob
placed at a local instead of a global position, a part not summed over cp, or rotary at local positions changes
them by O(1) of their scale (weights ~ N(0, 0.15): attention depends strongly on positions).
"""

from dataclasses import replace

import pytest
import torch
from test_cp_equivalence import NUM_ROWS, make_rows, write_model

from dockrl.config import AlgoConfig, TrainConfig, load_config, loss_plan
from dockrl.config.schema import ActorConfig, DistillConfig
from dockrl.config.specs import specs
from dockrl.config.step_plan import step_plan
from dockrl.dock.columns import TEACHER_TOPK_IDS, TEACHER_TOPK_LOGPROBS
from dockrl.parallel.dist import free_port
from dockrl.parallel.spawn import spawn_ranks
from helpers import assert_grads_close, full_grads

VALUE_ATOL_OF_SCALE = 1.2e-4
K = 6
CRITIC_METRICS = (
    "critic/value_loss",
    "critic/vpred_mean",
    "critic/grad_norm",
    "critic/explained_variance",
    "critic/values_mean",
    "critic/advantages_mean",
)
STUDENT_METRICS = ("loss", "pg_loss", "distill/topk_kl", "distill/teacher_tail_mass", "grad_norm")


class RowsDock:
    """A dock of one table for a critic rank: every row at each get, puts written back (`pull` for the
    ReplicaClient of a cp head, `get` for a worker without one)."""

    def __init__(self, columns: dict[str, list]) -> None:
        self.table = [dict(zip(columns, values)) for values in zip(*columns.values())]

    def pull(self, request):
        return self.get(
            request.consumer,
            request.columns,
            request.count,
            balance_over=request.balance_over,
            peer=request.peer,
        )

    def get(self, consumer, columns, count, *, balance_over, peer):
        assert count == len(self.table) and balance_over == 1 and peer == 0
        return list(range(count)), {c: [row[c] for row in self.table] for c in columns}

    def put(self, producer, rows, batch):
        for column, values in batch.items():
            for row, value in zip(rows, values):
                self.table[row][column] = value


def critic_rows(vocab: int) -> dict[str, list]:
    rows = make_rows(vocab)
    return {
        "prompt_ids": rows["prompt_ids"],
        "response_ids": rows["response_ids"],
        "reward": [float(i % 3) - 1.0 for i in range(NUM_ROWS)],
        "update_weight": [1.0] * NUM_ROWS,
    }


def critic_spec_and_plan(model_dir: str, data: str, cp: int):
    """The critic's spec and the step plan of a ppo run on NUM_ROWS rows, critic.cp = cp."""
    overrides = [f"model.path={model_dir}", f"data.train_path={data}", "algo.name=ppo", "run.steps=1"]
    overrides += ["run.prompts_per_step=4", "rollout.samples_per_prompt=2", "critic.micro_batch_size=3"]
    overrides += [f"critic.cp={cp}", "critic.grad_clip=1.0"]
    cfg = load_config(TrainConfig, None, overrides)
    plan = step_plan(cfg)
    return specs(cfg, plan).critic, plan


def critic_step(worker, rows: dict[str, list]) -> dict:
    """The values stage and one update on a worker whose engine is built; its figures and gradients."""
    dock = worker.client
    worker.compute_values()
    metrics = worker.update().metrics
    grads = full_grads(worker.engine)  # the last (only) mini-batch's, left by train_step
    return {"metrics": metrics, "table": dock.table if hasattr(dock, "table") else None, "grads": grads}


def teacher_pass(engine, rows: dict[str, list]) -> dict:
    """What TeacherWorker._score asks of its engine: the sampled tokens' log-probs, and the top-k."""
    common = dict(temperature=0.7, micro_batch_size=3, pad_token_id=0)
    logps, _ = engine.logprobs(rows["prompt_ids"], rows["response_ids"], **common)
    top = engine.top_k_logprobs(rows["prompt_ids"], rows["response_ids"], K, **common)
    return {"logps": logps, "top_logp": top[0], "ids": top[1], "top": top[2]}


def student_update(model_dir: str, batch: dict[str, list], mesh=None) -> tuple[dict, dict]:
    """One opd update with distill.top_k = K on every row; its metrics and gradients."""
    from dockrl.engines.train.policy_update import policy_update
    from dockrl.engines.train.train_engine import TrainEngine

    engine = TrainEngine(
        model_dir, device="cpu", precision="fp32", mesh=mesh, optim=ActorConfig(lr=1e-2, grad_clip=1.0)
    )
    plan = loss_plan(AlgoConfig(name="opd"), distill=DistillConfig(teacher_path="t", coef=0.5, top_k=K))
    update = dict(temperature=0.7, micro_batch_size=3, pad_token_id=0, world_size=1)
    metrics = policy_update(engine, batch, list(range(NUM_ROWS)), ["advantages"], plan, **update)
    return metrics, full_grads(engine)


def _worker(rank, world, port, model_dir, spec, plan, rows, batch, out_path, leave) -> None:
    from pathlib import Path

    from test_sharded_load import _whole_state

    from dockrl.checkpoint.directory import CRITIC
    from dockrl.checkpoint.sharded import save_engine
    from dockrl.engines.train.train_engine import TrainEngine
    from dockrl.parallel.dist import init_distributed, training_mesh
    from dockrl.workers.critic import CriticWorker

    torch.set_num_threads(1)
    init_distributed(rank, world, "127.0.0.1", port, "cpu", timeout_s=120)
    worker = CriticWorker(f"critic-{rank}", rank, world, spec=spec, plan=plan, client=RowsDock(rows))
    worker.device = torch.device("cpu")
    worker.setup()
    results = {"critic": critic_step(worker, rows)}
    save_engine(
        worker.engine, Path(out_path).parent / "checkpoint" / CRITIC
    )  # CriticWorker.save's state part
    results["critic_state"] = _whole_state(worker.engine)
    teacher = TrainEngine(
        model_dir, device="cpu", precision="fp32", mesh=training_mesh("cpu", 1, 1, world), trainable=False
    )
    results["teacher"] = teacher_pass(teacher, rows)
    results["student"] = student_update(model_dir, batch, training_mesh("cpu", 1, 1, world))
    gathered: list = [None] * world
    torch.distributed.all_gather_object(gathered, results)
    if rank == 0:
        torch.save(gathered, out_path)
    leave(rank)


def _rows_close(actual: list[torch.Tensor], expected: list[torch.Tensor], msg) -> None:
    """Row by row within VALUE_ATOL_OF_SCALE of the column's scale (its largest |value| over every row: a
    return that is a difference of O(1) terms, e.g. reward 0, is exact only up to theirs)."""
    scale = max(float(row.abs().max()) for row in expected)
    assert scale > 0, msg
    for i, (row, ref) in enumerate(zip(actual, expected, strict=True)):
        torch.testing.assert_close(row, ref, rtol=0, atol=VALUE_ATOL_OF_SCALE * scale, msg=(msg, i))


# DCP's note that the one-process resume below loads without a process group (that is the point)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_critic_teacher_and_top_k_student_under_cp_equal_one_process(tmp_path, arithmetic_data):
    from dockrl.engines.train.train_engine import TrainEngine
    from dockrl.models.value import value_model_kind
    from dockrl.workers.critic import CriticWorker

    model_dir = write_model(tmp_path / "model")
    teacher = TrainEngine(model_dir, device="cpu", precision="fp32", trainable=False)
    rows = critic_rows(teacher.args.vocab_size)
    expected_teacher = teacher_pass(teacher, rows)
    # the student's batch: random advantages and a teacher's top-k: the same weights at temperature 1.3 against
    # the student's 0.7, so the KL and its gradient are not 0
    _, ids, top = teacher.top_k_logprobs(
        rows["prompt_ids"], rows["response_ids"], K, temperature=1.3, micro_batch_size=3, pad_token_id=0
    )
    batch = {**make_rows(teacher.args.vocab_size), TEACHER_TOPK_IDS: ids, TEACHER_TOPK_LOGPROBS: top}
    spec, plan = critic_spec_and_plan(model_dir, arithmetic_data["train"], cp=2)
    out = tmp_path / "results.pt"
    spawn_ranks(_worker, 2, free_port(), model_dir, spec, plan, rows, batch, str(out))
    ranks = torch.load(out, weights_only=False)

    # the critic: one process, the same settings at cp = 1
    single_spec = replace(spec, optim=replace(spec.optim, cp=1))
    single = CriticWorker("critic-0", 0, 1, spec=single_spec, plan=plan, client=RowsDock(rows))
    single.engine = TrainEngine(
        model_dir, device="cpu", precision="fp32", optim=single_spec.optim, kind=value_model_kind(spec.seed)
    )
    expected = critic_step(single, rows)
    result = ranks[0]["critic"]  # the cp head wrote the dock
    for column in ("values", "advantages", "returns"):
        column_of = [row[column] for row in result["table"]]
        _rows_close(column_of, [row[column] for row in expected["table"]], column)
    for r, rank in enumerate(ranks):
        for key in CRITIC_METRICS:
            assert rank["critic"]["metrics"][key] == pytest.approx(
                expected["metrics"][key], rel=1e-4, abs=1e-6
            ), (r, key)
        assert_grads_close(rank["critic"]["grads"], expected["grads"], msg=("critic", r))
    assert expected["metrics"]["critic/grad_norm"] > 0

    # the critic's checkpoint saved under cp = 2 resumes in one process bit for bit (DCP shards over dp x cp)
    from test_sharded_load import _whole_state

    from dockrl.checkpoint.directory import CRITIC
    from dockrl.checkpoint.sharded import load_engine

    resumed = TrainEngine(
        model_dir,
        device="cpu",
        precision="fp32",
        optim=single_spec.optim,
        kind=value_model_kind(spec.seed),
        load_weights=False,
    )
    load_engine(resumed, tmp_path / "checkpoint" / CRITIC)
    saved, loaded = ranks[0]["critic_state"], _whole_state(resumed)
    assert any(k.endswith("/exp_avg_sq") for k in saved) and set(loaded) == set(saved)
    assert all(torch.equal(loaded[k], v) for k, v in saved.items())

    # the teacher: every cp rank returns every row's log-probs and top-k (ids exact where not near a tie)
    for r, rank in enumerate(ranks):
        got = rank["teacher"]
        for key in ("logps", "top_logp", "top"):
            _rows_close(got[key], expected_teacher[key], ("teacher", r, key))
        for i, (row_ids, ref_ids, ref_top) in enumerate(
            zip(got["ids"], expected_teacher["ids"], expected_teacher["top"])
        ):
            gap = (ref_top[:, :-1] - ref_top[:, 1:]).min(-1).values  # [R]: the closest neighbours
            clear = gap > 2 * VALUE_ATOL_OF_SCALE * float(ref_top.abs().max())
            assert clear.float().mean() > 0.5 and torch.equal(row_ids[clear], ref_ids[clear]), ("ids", r, i)

    # the student's top-k distillation update
    ref_metrics, ref_grads = student_update(model_dir, batch)
    assert ref_metrics["distill/topk_kl"] > 0 and ref_metrics["grad_norm"] > 0
    for r, rank in enumerate(ranks):
        metrics, grads = rank["student"]
        for key in STUDENT_METRICS:
            assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-4, abs=1e-6), (r, key)
        assert_grads_close(grads, ref_grads, msg=("student", r))
