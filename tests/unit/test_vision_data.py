"""Vision-language data: image rows (paths, base64, bytes) through the data pass into the dock's image columns,
their errors, the synthetic vision task and its reward, and the report's images."""

from __future__ import annotations

import base64
import io
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from dockrl.data.datasets import DatasetError
from dockrl.data.images import IMAGE_PAD, VISION_END, VISION_START
from dockrl.data.synthetic_vision import (
    ANSWERS,
    BACKGROUND,
    COLOURS,
    noisy_teacher_rows,
    vision_items,
    write_vision_task,
)
from dockrl.models.tokenizer import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, Tokenizer
from dockrl.models.vision_processing import processor_config
from dockrl.recipes.common import EncodedPrompt, encode_prompts

# 14-pixel patches merged 2 x 2: a 56 x 56 image is 4 x 4 patches, 4 prompt tokens; 112 x 84 is 8 x 6, 12.
PROCESSOR = {
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "min_pixels": 56 * 56,
    "max_pixels": 112 * 112,
}
QUESTION = "How many dots are in the image?"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    """A tiny ChatML tokenizer with Qwen2.5-VL's three vision tokens as single added tokens."""
    from dockrl.models.tiny import default_corpus, tokenizer_config, train_tokenizer

    added = (VISION_START, IMAGE_PAD, VISION_END)
    backend = train_tokenizer(default_corpus()[:200], 300, added)
    folder = tmp_path_factory.mktemp("vl_tokenizer")
    backend.save(str(folder / TOKENIZER_FILE))
    (folder / TOKENIZER_CONFIG_FILE).write_text(json.dumps(tokenizer_config(backend, 512, added)))
    return Tokenizer.from_dir(folder)


def _png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _images(n: int = 2):
    items = vision_items(3, seed=1, size=56)
    from PIL import Image

    wide = Image.new("RGB", (112, 84), (200, 30, 30))  # not square: 8 x 6 patches
    return [items[0].image, wide][:n]


def _encode(path: Path, tokenizer: Tokenizer, **kwargs):
    return encode_prompts(
        str(path),
        tokenizer,
        prompt_field="prompt",
        label_field="answer",
        system_prompt=None,
        use_chat_template=True,
        max_prompt_len=512,
        processor=processor_config(PROCESSOR),
        model_path="tiny-vl",
        **kwargs,
    )


def _write_rows(tmp_path: Path, form: str) -> Path:
    """One row holding the two test images, the first before the question and the second after, as `form`."""
    first, second = (_png(image) for image in _images())
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(first)
    (tmp_path / "imgs" / "b.png").write_bytes(second)
    values = {
        "path": ["imgs/a.png", str(tmp_path / "imgs" / "b.png")],  # relative to the data file, and absolute
        "base64": [
            base64.b64encode(first).decode(),
            "data:image/png;base64," + base64.b64encode(second).decode(),
        ],
        "bytes": [first, second],
        "struct": [{"bytes": first, "path": None}, {"bytes": None, "path": "imgs/b.png"}],
    }
    if form == "marker":  # the images field with <image> markers in a text prompt
        row = {"prompt": f"<image>{QUESTION}<image>", "images": ["imgs/a.png", "imgs/b.png"], "answer": "3"}
    else:
        one, two = values[form]
        content = [
            {"type": "image", "image": one},
            {"type": "text", "text": QUESTION},
            {"type": "image", "image": two},
        ]
        row = {"prompt": [{"role": "user", "content": content}], "answer": "3"}
    if form in ("bytes", "struct"):  # binary cells: Parquet
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "rows.parquet"
        pq.write_table(pa.Table.from_pylist([row]), path)
        return path
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(row) + "\n")
    return path


def _reference_patches(images) -> tuple[np.ndarray, np.ndarray]:
    """transformers' own PIL image processor, stopped before rescale and normalize (an independent path)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(
        do_rescale=False,
        do_normalize=False,
        min_pixels=PROCESSOR["min_pixels"],
        max_pixels=PROCESSOR["max_pixels"],
        patch_size=14,
        temporal_patch_size=2,
        merge_size=2,
    )
    out = processor(images=list(images), return_tensors=None)
    values = np.asarray(out["pixel_values"])
    assert np.array_equal(values, np.round(values))  # whole numbers: uint8 holds them exactly
    return values.astype(np.uint8), np.asarray(out["image_grid_thw"])


@pytest.mark.parametrize("form", ["path", "base64", "bytes", "struct", "marker"])
def test_image_rows_give_the_processors_patches_and_expanded_tokens(tmp_path, tokenizer, form):
    prompts, skipped = _encode(_write_rows(tmp_path, form), tokenizer)
    assert skipped == 0 and len(prompts) == 1
    prompt = prompts[0]
    patches, grid = _reference_patches(_images())
    assert prompt.image_patches.dtype == torch.uint8 and prompt.image_grid_thw.dtype == torch.int64
    assert prompt.image_grid_thw.tolist() == grid.tolist() == [[1, 4, 4], [1, 6, 8]]
    assert torch.equal(prompt.image_patches, torch.from_numpy(patches))  # [16 + 48, 1176], bit for bit
    # The prompt holds each image's 16/4 and 48/4 pads in its place: image, question, image.
    start, pad, end = (tokenizer.encode(t)[0] for t in (VISION_START, IMAGE_PAD, VISION_END))
    ids = prompt.ids
    assert ids.count(pad) == 4 + 12 and ids.count(start) == ids.count(end) == 2
    first = ids.index(start)
    assert ids[first + 1 : first + 6] == [pad] * 4 + [end]
    second = ids.index(start, first + 1)
    assert ids[second + 1 : second + 14] == [pad] * 12 + [end]
    assert QUESTION in tokenizer.decode(ids[first + 6 : second])
    assert [(i["width"], i["height"]) for i in prompt.images] == [(56, 56), (112, 84)]
    if form == "path":
        assert [i["ref"] for i in prompt.images] == [str(tmp_path / "imgs" / n) for n in ("a.png", "b.png")]
    if form == "base64":
        assert all(i["ref"].startswith("base64:") for i in prompt.images)


def test_a_text_row_of_a_vision_run_has_zero_images(tmp_path, tokenizer):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "What is 2+3?", "answer": "5"}) + "\n")
    (prompt,), _ = _encode(path, tokenizer)
    assert prompt.image_patches.shape == (0, 1176) and prompt.image_grid_thw.shape == (0, 3)
    assert prompt.images == [] and tokenizer.encode(IMAGE_PAD)[0] not in prompt.ids


def _one_image_row(tmp_path: Path, image: str) -> Path:
    path = tmp_path / "rows.jsonl"
    good = {"prompt": "<image>count", "images": ["ok.png"], "answer": "1"}
    bad = {
        "prompt": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "count"},
                    {"type": "image", "image": "ok.png"},
                    {"type": "image", "image": image},
                ],
            }
        ],
        "answer": "2",
    }  # noqa: E501
    (tmp_path / "ok.png").write_bytes(_png(_images(1)[0]))
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    return path


def test_a_missing_image_names_the_file_the_line_and_the_image(tmp_path, tokenizer):
    path = _one_image_row(tmp_path, "gone/nothing.png")
    with pytest.raises(DatasetError) as caught:
        _encode(path, tokenizer)
    message = str(caught.value)
    assert message.startswith(f"{path}: line 2: image 2 ({tmp_path / 'gone' / 'nothing.png'}) ")
    assert "does not exist" in message


def test_a_corrupt_image_names_the_file_the_line_and_the_image(tmp_path, tokenizer):
    (tmp_path / "cut.png").write_bytes(_png(_images(1)[0])[:60])  # a PNG cut short
    path = _one_image_row(tmp_path, "cut.png")
    with pytest.raises(
        DatasetError, match=rf"^{path}: line 2: image 2 \({tmp_path / 'cut.png'}\) cannot be decoded"
    ):
        _encode(path, tokenizer)
    not_base64 = "QUJD" * 30 + "!"  # long, no image suffix, not base64: read as a path that does not exist
    with pytest.raises(DatasetError, match=r"line 2: image 2 .* does not exist"):
        _encode(_one_image_row(tmp_path, not_base64), tokenizer)
    garbage = base64.b64encode(b"not an image at all" * 8).decode()  # valid base64 of no image
    with pytest.raises(DatasetError, match=r"line 2: image 2 \(base64:[0-9a-f]{16}\) cannot be decoded"):
        _encode(_one_image_row(tmp_path, garbage), tokenizer)


def test_images_that_do_not_match_their_places_are_refused(tmp_path, tokenizer):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "<image> and <image>", "images": ["a.png"], "answer": "1"}) + "\n")
    with pytest.raises(
        DatasetError, match=r"line 1: the prompt has 2 <image> markers and the images field 1"
    ):
        _encode(path, tokenizer)


def test_a_text_model_given_image_rows_is_told_the_fix(tmp_path, tokenizer):
    path = _one_image_row(tmp_path, "ok.png")
    with pytest.raises(
        DatasetError, match=r"2 rows have images \(first at line 1\) but model.path=tiny-lm is a text"
    ):
        encode_prompts(
            str(path),
            tokenizer,
            prompt_field="prompt",
            label_field="answer",
            system_prompt=None,
            use_chat_template=True,
            max_prompt_len=512,
            model_path="tiny-lm",
        )


def test_a_tokenizer_without_the_vision_tokens_is_refused(tmp_path, tmp_path_factory):
    from dockrl.models.tiny import default_corpus, tokenizer_config, train_tokenizer

    backend = train_tokenizer(default_corpus()[:200], 300)
    folder = tmp_path_factory.mktemp("lm_tokenizer")
    backend.save(str(folder / TOKENIZER_FILE))
    (folder / TOKENIZER_CONFIG_FILE).write_text(json.dumps(tokenizer_config(backend, 512)))
    with pytest.raises(
        DatasetError, match=r"line 1: the prompt holds 0 <\|image_pad\|> tokens for its images' 4"
    ):
        _encode(_one_image_row(tmp_path, "ok.png"), Tokenizer.from_dir(folder))


# ------------------------------------------------------------------------------------------- the dock


def _vision_prompts(tmp_path: Path, tokenizer: Tokenizer) -> list[EncodedPrompt]:
    paths = write_vision_task(tmp_path / "task", num_train=3, num_test=0, size=56)
    wide = tmp_path / "wide.png"
    wide.write_bytes(_png(_images()[1]))
    rows = paths["train"].read_text().splitlines() + [
        json.dumps(
            {"prompt": "<image><image>both", "images": [str(wide), "images/train_00000.png"], "answer": "x"}
        ),
        json.dumps({"prompt": "no image", "answer": "y"}),
    ]
    paths["train"].write_text("\n".join(rows) + "\n")
    prompts, _ = _encode(paths["train"], tokenizer)
    return prompts


def _socket_dock():
    from dockrl.dock.central import CentralClient, CentralDock, HubTransport
    from dockrl.dock.transport import ServiceHub

    hub = ServiceHub(CentralDock())
    ServiceHub._local.pop(hub.address)  # frames over the socket, as between processes
    return hub, CentralClient(HubTransport(hub.address, hub.authkey), "driver", get_timeout_s=30)


def test_image_columns_round_trip_through_the_dock_to_their_readers_only(tmp_path, tokenizer):
    from dockrl.dock import DockError
    from dockrl.dock.columns import IMAGE_GRID_THW, IMAGE_PATCHES, IMAGE_REFS, PROMPT_IDS
    from dockrl.dock.stages import Stage
    from dockrl.recipes.common import add_prompts

    prompts = _vision_prompts(tmp_path, tokenizer)
    hub, client = _socket_dock()
    try:
        rows = add_prompts(client, prompts, 2)
        assert rows == list(range(10))
        got_rows, batch = client.get(
            Stage.ROLLOUT, [PROMPT_IDS, IMAGE_PATCHES, IMAGE_GRID_THW], 10, timeout_s=10
        )
        assert got_rows == rows
        for row in rows:
            prompt = prompts[row // 2]
            assert batch[PROMPT_IDS][row].tolist() == prompt.ids
            assert batch[IMAGE_PATCHES][row].dtype == torch.uint8
            assert torch.equal(batch[IMAGE_PATCHES][row], prompt.image_patches)
            assert torch.equal(batch[IMAGE_GRID_THW][row], prompt.image_grid_thw)
        assert [len(g) for g in batch[IMAGE_GRID_THW][::2]] == [1, 1, 1, 2, 0]
        _, refs = client.get(Stage.REWARD, [IMAGE_REFS], 10, timeout_s=10)
        assert refs[IMAGE_REFS][6] == prompts[3].images and refs[IMAGE_REFS][8] == []
        with pytest.raises(DockError, match="image_patches.* by stage 'reward'"):
            client.get(Stage.REWARD, [IMAGE_PATCHES], 1, timeout_s=1)
    finally:
        hub.close()


def test_a_checkpoint_in_flight_puts_the_image_columns_back(tmp_path, tokenizer):
    """save_inflight of a generated step, load_inflight into a fresh dock: every row's images come back."""
    from dockrl.dock.choice import DockChoice
    from dockrl.dock.columns import IMAGE_GRID_THW, IMAGE_PATCHES, IMAGE_REFS, RESPONSE_IDS
    from dockrl.dock.stages import Stage
    from dockrl.recipes.common import add_prompts
    from dockrl.recipes.inflight import Generation, load_inflight, save_inflight

    prompts = _vision_prompts(tmp_path, tokenizer)
    columns = [IMAGE_PATCHES, IMAGE_GRID_THW, IMAGE_REFS]
    hub, client = _socket_dock()
    fresh_hub, fresh = _socket_dock()
    try:
        saved = DockChoice([client])
        rows = add_prompts(saved, prompts, 2)
        saved.put(Stage.ROLLOUT, rows, {RESPONSE_IDS: [torch.tensor([r]) for r in rows]})
        generation = Generation(3, 2, 0, prompts, 0.0, 0.0, None, results=([], [], 0.0))
        assert save_inflight(tmp_path, [generation], saved) == 10
        before = saved.peek(columns)
        loaded = load_inflight(tmp_path, DockChoice([fresh]), 2)
        assert list(loaded) == [3]
        after = fresh.peek(columns)
        assert after[0] == before[0] == rows
        for column in (IMAGE_PATCHES, IMAGE_GRID_THW):
            assert all(torch.equal(a, b) for a, b in zip(after[1][column], before[1][column]))
        assert after[1][IMAGE_REFS] == before[1][IMAGE_REFS]
        assert [torch.equal(p.image_patches, q.image_patches) for p, q in zip(loaded[3].batch, prompts)] == [
            True
        ] * 5
    finally:
        hub.close()
        fresh_hub.close()


# ---------------------------------------------------------------------------------- the synthetic task


def _count_dots(pixels: np.ndarray) -> int:
    """Connected components of dark pixels (4-neighbours)."""
    dark = pixels.sum(axis=2) < 3 * 128
    seen = np.zeros_like(dark)
    count = 0
    for y, x in zip(*np.nonzero(dark)):
        if seen[y, x]:
            continue
        count += 1
        stack = [(y, x)]
        seen[y, x] = True
        while stack:
            cy, cx = stack.pop()
            for ny, nx in ((cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)):
                if 0 <= ny < dark.shape[0] and 0 <= nx < dark.shape[1] and dark[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    stack.append((ny, nx))
    return count


def _shape_colour(pixels: np.ndarray) -> str:
    painted = pixels[(pixels != BACKGROUND).any(axis=2)].astype(float)
    mean = painted.mean(axis=0)
    return min(COLOURS, key=lambda name: float(((np.array(COLOURS[name]) - mean) ** 2).sum()))


def _taller_bar(pixels: np.ndarray) -> str:
    painted = (pixels != BACKGROUND).any(axis=2)
    half = pixels.shape[1] // 2
    left, right = painted[:, :half].any(axis=1).sum(), painted[:, half:].any(axis=1).sum()
    return "left" if left > right else "right"


def test_the_synthetic_answers_are_read_back_from_the_pixels(tmp_path):
    from PIL import Image

    paths = write_vision_task(tmp_path, num_train=60, num_test=15, size=56, seed=3)
    read = {"count": lambda p: str(_count_dots(p)), "colour": _shape_colour, "bars": _taller_bar}
    seen, answers = set(), {k: set() for k in read}
    for split in ("train", "test"):
        for line in paths[split].read_text().splitlines():
            row = json.loads(line)
            (part,) = [p for p in row["prompt"][0]["content"] if p["type"] == "image"]
            pixels = np.asarray(Image.open(tmp_path / part["image"]).convert("RGB"))
            assert pixels.shape == (56, 56, 3)
            assert read[row["task"]](pixels) == row["answer"], (part["image"], row)
            seen.add(pixels.tobytes())
            answers[row["task"]].add(row["answer"])
    assert len(seen) == 75  # no image twice: train and test are disjoint
    assert answers["count"] == set(ANSWERS["count"]) and answers["bars"] == {"left", "right"}
    assert answers["colour"] == set(COLOURS)


def test_no_image_is_drawn_twice_even_where_draws_repeat():
    """28 x 28 bars have 306 distinct pictures (heights 5-25, at least 4 apart): 250 draws repeat some, kept out."""
    items = vision_items(250, kinds=("bars",), size=28, seed=0)
    assert len({item.image.tobytes() for item in items}) == 250  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="n=320: only 306 distinct images"):
        vision_items(320, kinds=("bars",), size=28, seed=0)


def test_the_reward_reads_numbers_and_words_and_the_teacher_is_noisy_as_asked(tmp_path):
    from dockrl.rewards.builtin import exact_answer

    assert exact_answer("", "I count 7 dots.", "7").score == 1.0
    assert exact_answer("", "I count 7 dots, no 8", "7").score == 0.0
    assert exact_answer("", "The shape is red.", "red").score == 1.0
    assert exact_answer("", "red? no, blue", "red").score == 0.0
    assert exact_answer("", "left", "right").score == 0.0
    assert exact_answer("", "\\boxed{left}", "left").score == 1.0
    rows = [
        {"prompt": "p", "answer": random.Random(i).choice(ANSWERS[k]), "task": k}
        for i, k in enumerate(ANSWERS)
    ] * 400
    taught = noisy_teacher_rows(rows, error=0.25, samples=2, seed=5)
    assert len(taught) == 2 * len(rows)
    wrong = [t for t, r in zip(taught, [r for r in rows for _ in range(2)]) if t["answer"] != r["answer"]]
    assert all(t["answer"] in ANSWERS[t["task"]] for t in taught)
    # 2400 draws at p = 0.25: the count's std is sqrt(2400 * 0.25 * 0.75) = 21.2; 5 std either side
    assert abs(len(wrong) - 600) < 5 * 21.2
    # The hedging teacher (the vision demo's): its errors are the right answer then another one, which
    # exact_answer marks wrong; the same draws as the plain teacher's.
    hedged = noisy_teacher_rows(rows, error=0.25, samples=2, seed=5, hedge=True)
    right = [r["answer"] for r in rows for _ in range(2)]
    for h, t, r in zip(hedged, taught, right):
        if t["answer"] == r:
            assert h["answer"] == r
        else:
            assert h["answer"] == f"{r} or {t['answer']}"
            assert exact_answer("", h["answer"], r).score == 0.0


# ------------------------------------------------------------------------------------------- the report


def test_the_report_shows_each_samples_image_beside_its_answer(tmp_path):
    from dockrl.observe.loggers import markdown_table
    from dockrl.observe.report import write_report

    paths = write_vision_task(tmp_path / "data", num_train=2, num_test=0, size=56)
    image = (tmp_path / "data" / "images" / "train_00001.png").absolute()
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    sample = {"step": 1, "prompt": "What colour?", "response": "red", "label": "red", "reward": 1.0}
    images = [
        {"ref": str(image), "width": 56, "height": 56},
        {"ref": "base64:0123456789abcdef", "width": 9, "height": 7},
    ]
    (run / "samples.jsonl").write_text(json.dumps({**sample, "images": images}) + "\n")
    page = Path(write_report([run])["report"]).read_text()
    uri = "data:image/png;base64," + base64.b64encode(image.read_bytes()).decode()
    assert f"<img src='{uri}'" in page and page.index(uri) < page.index("<pre>red</pre>")
    assert f"{image} (56x56)" in page and "base64:0123456789abcdef (9x7)" in page
    assert page.count("<img src='data:") == 1  # an inline image's reference has no pixels to show
    table = markdown_table([{**sample, "images": images}])
    assert f"| {image} (56x56); base64:0123456789abcdef (9x7) |" in table
    assert paths["train"].is_file()


def test_a_vision_runs_samples_name_their_images_never_their_pixels(tmp_path, tokenizer):
    """The reward workers of a vision-language model's run read image_refs (not the patches) and copy each
    sampled row's images into samples.jsonl's record; a text model's workers never ask for the column."""
    from dockrl.config.schema import AlgoConfig, RewardConfig
    from dockrl.config.specs import RewardStageSpec
    from dockrl.dock.columns import IMAGE_REFS
    from dockrl.workers.reward import RewardWorker
    from helpers import FakeDock

    prompts = _vision_prompts(tmp_path, tokenizer)[:2]
    model = tmp_path / "vl"
    tokenizer.save(model)
    responses = [tokenizer.encode(r) for r in ("7", "3", "red", "blue")]
    columns = {
        "prompt_ids": [torch.tensor(prompts[i // 2].ids) for i in range(4)],
        "response_ids": [torch.tensor(r) for r in responses],
        "label": [prompts[i // 2].label for i in range(4)],
        "policy_version": [torch.zeros(len(r), dtype=torch.int64) for r in responses],
        IMAGE_REFS: [prompts[i // 2].images for i in range(4)],
    }

    def samples(vision: bool) -> list[dict]:
        (model / "config.json").write_text(json.dumps({"vision_config": {}} if vision else {}))
        spec = RewardStageSpec(
            reward=RewardConfig(num_processes=0, groups_per_pull=2),
            algo=AlgoConfig(name="grpo"),
            estimator="grpo",
            tokenizer_path=str(model),
            group_size=2,
            log_samples=4,
        )
        dock = FakeDock(dict(columns), group_size=2)
        worker = RewardWorker("reward-0", 0, 1, spec=spec, client=dock)
        out = worker.score().samples
        worker.close()
        return out

    shown = samples(True)
    assert [s["images"] for s in shown] == [prompts[i // 2].images for i in range(4)]
    assert shown[0]["images"][0]["ref"].endswith("images/train_00000.png") and "patches" not in json.dumps(
        shown
    )
    assert all("images" not in s for s in samples(False))


def test_sft_examples_of_the_noisy_teacher_carry_their_images(tmp_path, tokenizer):
    """dockrl sft's examples (recipes/sft.py build_examples) read images as the RL data pass does; a text
    model given them is told the fix."""
    from PIL import Image

    from dockrl.config import SFTConfig, load_config
    from dockrl.models.vision_processing import PREPROCESSOR_FILE
    from dockrl.recipes.sft import build_examples

    paths = write_vision_task(
        tmp_path / "task", num_train=6, num_test=0, teacher_error=0.5, teacher_samples=2
    )
    model = tmp_path / "vl"
    tokenizer.save(model)
    (model / PREPROCESSOR_FILE).write_text(json.dumps(PROCESSOR))
    (model / "config.json").write_text(json.dumps({"vision_config": {}}))
    overrides = [f"model.path={model}", f"data.train_path={paths['sft']}", "data.label_field=answer"]
    cfg = load_config(SFTConfig, None, overrides)
    examples, skipped = build_examples(cfg, tokenizer, str(paths["sft"]))
    rows = [json.loads(line) for line in paths["sft"].read_text().splitlines()]
    assert len(examples) == len(rows) == 12 and sum(skipped.values()) == 0
    pad = tokenizer.encode(IMAGE_PAD)[0]
    for example, row in zip(examples, rows):
        image = row["prompt"][0]["content"][0]["image"]
        patches, grid = _reference_patches([Image.open(paths["sft"].parent / image).convert("RGB")])
        assert torch.equal(example.images[0], torch.from_numpy(patches)) and example.images[1].tolist() == [
            [1, 4, 4]
        ]
        assert example.prompt.count(pad) == 4
        assert tokenizer.decode(example.answer) == row["answer"]
    assert sum(
        r["answer"] != json.loads(t)["answer"]
        for r, t in zip(rows[::2], paths["train"].read_text().splitlines())
    )
    (model / "config.json").write_text(json.dumps({}))  # a text model
    with pytest.raises(
        DatasetError, match=r"12 rows have images \(first at line 1\) but model.path=.* is a text model"
    ):
        build_examples(cfg, tokenizer, str(paths["sft"]))


def test_sft_micro_batches_feed_each_row_its_own_images(tmp_path):
    """dockrl sft trains a vision model on its rows' images: the answer loss of a micro-batch is the model's
    forward on those images (equal to a micro-batch built by hand from the same rows), and swapping the rows'
    images changes it by far more than fp32 rounding (so the images reach the model)."""
    from dockrl.config import SFTConfig, load_config
    from dockrl.engines.train.train_engine import TrainEngine
    from dockrl.models.tiny import make_tiny
    from dockrl.recipes.sft import _answer_nll_and_hits, _micro_batches, build_examples

    paths = write_vision_task(
        tmp_path / "task", num_train=4, num_test=0, teacher_error=0.0, teacher_samples=1
    )
    model = make_tiny(tmp_path / "vl", family="qwen2_5_vl", seed=0)
    cfg = load_config(
        SFTConfig, None, [f"model.path={model}", f"data.train_path={paths['sft']}", "data.label_field=answer"]
    )
    tokenizer = Tokenizer.from_dir(model)
    examples, _ = build_examples(cfg, tokenizer, str(paths["sft"]))
    assert all(e.images is not None and len(e.images[1]) == 1 for e in examples)
    assert not torch.equal(examples[0].images[0], examples[1].images[0])
    engine = TrainEngine(str(model), device="cpu", precision="fp32", optim=cfg.actor, packing=False)
    pad = tokenizer.pad_token_id or 0

    def answer_nll(batch) -> float:
        (mb,) = _micro_batches(engine, batch, pad, cfg.actor)
        with torch.no_grad():
            return float(_answer_nll_and_hits(engine.logits(mb), mb)[0])

    swapped = [
        examples[0]._replace(images=examples[1].images),
        examples[1]._replace(images=examples[0].images),
    ]
    own, other = answer_nll(examples[:2]), answer_nll(swapped)
    # fp32: each logit is a sum over a few thousand products; a relative 1e-4 is far above its rounding
    assert abs(own - other) > 1e-4 * abs(own), (own, other)
    assert answer_nll(examples[:2]) == own  # deterministic
