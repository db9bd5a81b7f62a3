"""A vision-language policy (qwen2_5_vl) trains the same under FSDP2 and tensor parallelism as in one process:
(dp, tp) in (2, 1), (1, 2), (2, 2), packed micro-batches, the vision tower trained (actor.vision.freeze=false)
and replicated over tp. Rows 0-3 have images and rows 4-7 are text, so at dp=2 one rank's rows have no image
and its tower runs on a blank image (zero gradients) to keep FSDP2's collectives in step.

Bounds: tests/distributed/test_tp_equivalence.py's (fp32 reassociation of the gradient sums, helpers.GRAD_RTOL).
"""

import numpy as np
import pytest
import torch
from PIL import Image

from dockrl.config import ActorConfig, AlgoConfig, VisionConfig, loss_plan
from dockrl.parallel.dist import free_port
from dockrl.parallel.spawn import spawn_ranks
from helpers import assert_grads_close, full_grads

pytestmark = pytest.mark.distributed

NUM_ROWS = 8
ALGO = AlgoConfig(kl_coef=0.0, clip_low=0.2, clip_high=0.28, entropy_coef=0.01)
LAYOUTS = [(2, 1), (1, 2), (2, 2)]


def make_rows(model_dir: str) -> dict[str, list]:
    """Rows 0-3 with one or two images (different sizes), rows 4-7 text only; per-token columns."""
    from dockrl.models.config import read_config
    from dockrl.models.vision_processing import image_token_count, process_images

    args = read_config(model_dir)
    ids = args.vision_token_ids
    g = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    batch: dict[str, list] = {k: [] for k in ("prompt_ids", "response_ids", "advantages", "old_logprobs")}
    batch["image_patches"], batch["image_grid_thw"] = [], []
    for i in range(NUM_ROWS):
        sizes = [(56 + 28 * i, 84), (56, 112)][: 2 if i == 1 else 1] if i < 4 else []
        images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
        patches, grid = process_images(model_dir, images)
        prompt = torch.randint(3, 400, (3 + i % 3,), generator=g).tolist()
        for count in image_token_count(grid, 2):
            prompt += [ids["vision_start"]] + [ids["image"]] * count + [ids["vision_end"]]
        r = 2 + (i * 3) % 5
        batch["prompt_ids"].append(torch.tensor(prompt + [7]))
        batch["response_ids"].append(torch.randint(3, 400, (r,), generator=g))
        batch["advantages"].append(torch.full((r,), float(torch.randn(1, generator=g))))
        batch["old_logprobs"].append(-torch.rand(r, generator=g) * 5)
        batch["image_patches"].append(torch.from_numpy(patches))
        batch["image_grid_thw"].append(torch.from_numpy(grid))
    return batch


def run_update(model_dir: str, idx: list[int], dp: int, mesh=None):
    """One policy update on rows idx; returns (metrics, whole gradients)."""
    from dockrl.engines.train.policy_update import policy_update
    from dockrl.engines.train.train_engine import TrainEngine

    optim = ActorConfig(lr=1e-2, grad_clip=1.0, micro_batch_size=2, vision=VisionConfig(freeze=False))
    engine = TrainEngine(
        model_dir, device="cpu", precision="fp32", mesh=mesh, optim=optim, packing=True, freeze_vision=False
    )
    metrics = policy_update(
        engine,
        make_rows(model_dir),
        idx,
        ["advantages", "old_logprobs"],
        loss_plan(ALGO),
        temperature=1.0,
        micro_batch_size=2,
        pad_token_id=0,
        world_size=dp,
    )
    return metrics, full_grads(engine)


def _worker(rank: int, world: int, port: int, model_dir: str, out_path: str, leave) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from dockrl.parallel.dist import init_distributed

    torch.set_num_threads(1)
    init_distributed(rank, world, "127.0.0.1", port, "cpu", timeout_s=120)
    results = {}
    for dp, tp in LAYOUTS:
        mesh = init_device_mesh("cpu", (world // (dp * tp), dp, tp), mesh_dim_names=("rep", "dp", "tp"))
        per_rank = NUM_ROWS // dp
        dp_rank = mesh["dp"].get_local_rank()
        idx = list(range(dp_rank * per_rank, (dp_rank + 1) * per_rank))
        results[(dp, tp)] = run_update(model_dir, idx, dp, mesh["dp", "tp"])
    if rank == 0:
        torch.save(results, out_path)
    leave(rank)


def test_fsdp_and_tp_layouts_train_a_vision_model_as_one_process(tmp_path):
    from dockrl.models.tiny import make_tiny

    model_dir = str(make_tiny(tmp_path / "vl", family="qwen2_5_vl", hidden_size=32, num_layers=2))
    out = tmp_path / "results.pt"
    spawn_ranks(_worker, 4, free_port(), model_dir, str(out))
    results = torch.load(out, weights_only=False)
    ref_metrics, ref_grads = run_update(model_dir, list(range(NUM_ROWS)), dp=1)
    assert ref_metrics["grad_norm"] > 0
    assert float(ref_grads["visual.patch_embed.proj.weight"].abs().max()) > 0  # the tower trains
    for (dp, tp), (metrics, grads) in results.items():
        for key in ("loss", "pg_loss", "entropy", "grad_norm"):
            assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-4, abs=1e-6), (dp, tp, key)
        assert_grads_close(grads, ref_grads, msg=(dp, tp))
