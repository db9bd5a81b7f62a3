"""A synthetic vision task for tests and demos: small PIL drawings with one verifiable answer each.

    count   1-9 black dots on white             "How many dots are in the image?"          -> "1" .. "9"
    colour  one shape (circle, square, triangle) in red, green, blue or yellow
                                                "What colour is the shape?"                -> "red" ...
    bars    two grey bars of clearly different heights
                                                "Which bar is taller, left or right?"      -> "left" / "right"

`write_vision_task` writes train.jsonl and test.jsonl (disjoint: no image drawn twice), their PNG files under
images/, and with `teacher_error` sft.jsonl: a noisy teacher's answers to the training images (the right one,
or with probability `teacher_error` another answer of the same question), the warm start RL then corrects.
Rows are chat messages with an image part (docs/vision.md, "Data"); images are `size` x `size` pixels (56: a
Qwen2.5-VL processor with 14-pixel patches and merge 2 cuts it into 16 patches, 4 prompt tokens). The answer is
checked by `exact_answer` (a number for count, the last word otherwise; rewards/builtin.py).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dockrl.data.synthetic import write_jsonl

COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 160, 40),
    "blue": (30, 60, 220),
    "yellow": (235, 200, 20),
}
BACKGROUND = (255, 255, 255)
DOT_COLOUR = (0, 0, 0)
BAR_COLOUR = (90, 90, 90)
QUESTIONS = {
    "count": "How many dots are in the image? Answer with a number.",
    "colour": "What colour is the shape? Answer red, green, blue or yellow.",
    "bars": "Which bar is taller, left or right?",
}
ANSWERS = {
    "count": [str(n) for n in range(1, 10)],
    "colour": list(COLOURS),
    "bars": ["left", "right"],
}
VISION_KINDS = tuple(QUESTIONS)


@dataclass
class VisionItem:
    """One drawn question: its kind (a VISION_KINDS name), the image (PIL, RGB) and the right answer."""

    kind: str
    image: object
    answer: str


def draw_count(rng: random.Random, size: int):
    """1-9 non-touching black dots of radius size // 20 (at least 2) on white; returns (image, "n")."""
    from PIL import Image, ImageDraw

    count = rng.randint(1, 9)
    radius = max(2, size // 20)
    gap = 2 * radius + 3  # centre distance: two dots never touch, so they count apart
    centres: list[tuple[int, int]] = []
    while len(centres) < count:
        x, y = rng.randint(radius + 1, size - radius - 2), rng.randint(radius + 1, size - radius - 2)
        if all((x - a) ** 2 + (y - b) ** 2 >= gap * gap for a, b in centres):
            centres.append((x, y))
    image = Image.new("RGB", (size, size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for x, y in centres:
        draw.ellipse((x - radius, y - radius, x + radius, y + radius), fill=DOT_COLOUR)
    return image, str(count)


def draw_colour(rng: random.Random, size: int):
    """One circle, square or triangle, 40-80% of the side, in one of COLOURS on white; returns (image, name)."""
    from PIL import Image, ImageDraw

    name = rng.choice(list(COLOURS))
    side = rng.randint(int(0.4 * size), int(0.8 * size))
    x0, y0 = rng.randint(0, size - side), rng.randint(0, size - side)
    image = Image.new("RGB", (size, size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    box = (x0, y0, x0 + side - 1, y0 + side - 1)
    shape = rng.choice(("circle", "square", "triangle"))
    if shape == "circle":
        draw.ellipse(box, fill=COLOURS[name])
    elif shape == "square":
        draw.rectangle(box, fill=COLOURS[name])
    else:
        draw.polygon(
            [(x0, y0 + side - 1), (x0 + side - 1, y0 + side - 1), (x0 + side // 2, y0)], fill=COLOURS[name]
        )
    return image, name


def draw_bars(rng: random.Random, size: int):
    """Two grey bars standing on the bottom edge, heights 20-90% of the side and at least 15% apart; returns
    (image, "left" or "right", the taller)."""
    from PIL import Image, ImageDraw

    low, high, apart = int(0.2 * size), int(0.9 * size), max(2, int(0.15 * size))
    while True:
        left, right = rng.randint(low, high), rng.randint(low, high)
        if abs(left - right) >= apart:
            break
    width = max(3, size // 5)
    image = Image.new("RGB", (size, size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for x, height in ((size // 4 - width // 2, left), (3 * size // 4 - width // 2, right)):
        draw.rectangle((x, size - height, x + width - 1, size - 1), fill=BAR_COLOUR)
    return image, "left" if left > right else "right"


DRAW: dict[str, Callable] = {"count": draw_count, "colour": draw_colour, "bars": draw_bars}


def vision_items(
    n: int, *, seed: int = 0, size: int = 56, kinds: tuple[str, ...] = VISION_KINDS
) -> list[VisionItem]:
    """`n` items, kinds in turn, no two with the same pixels; deterministic for (seed, size, kinds). Raises
    ValueError when the kinds cannot make `n` distinct images at this size."""
    unknown = sorted(set(kinds) - set(VISION_KINDS))
    if not kinds or unknown:
        raise ValueError(f"kinds={kinds!r}: use a non-empty subset of {VISION_KINDS}")
    if size < 28:
        raise ValueError(f"size={size}: draw at least 28 x 28 pixels (one merged Qwen2.5-VL patch)")
    rng = random.Random(seed)
    seen: set[str] = set()
    items: list[VisionItem] = []
    for _ in range(100 * n + 1000):  # each draw is new with good odds until the distinct images run out
        if len(items) == n:
            break
        kind = kinds[len(items) % len(kinds)]
        image, answer = DRAW[kind](rng, size)
        digest = hashlib.sha256(image.tobytes()).hexdigest()
        if digest not in seen:  # a redrawn duplicate keeps train and test apart
            seen.add(digest)
            items.append(VisionItem(kind, image, answer))
    if len(items) < n:
        raise ValueError(
            f"n={n}: only {len(items)} distinct images drawn for kinds={kinds}, size={size}; draw larger"
        )
    return items


def vision_row(item: VisionItem, image_path: str) -> dict:
    """The prompt row of an item: a user message with the image then the question, the answer, the kind."""
    content = [{"type": "image", "image": image_path}, {"type": "text", "text": QUESTIONS[item.kind]}]
    return {"prompt": [{"role": "user", "content": content}], "answer": item.answer, "task": item.kind}


def noisy_teacher_rows(
    rows: list[dict], *, error: float, samples: int, seed: int = 0, hedge: bool = False
) -> list[dict]:
    """SFT rows of a noisy teacher: `samples` answers per row, each the right one or, with probability
    `error`, another answer of the same question (label noise the RL stage then corrects). With `hedge` the
    teacher's error is a habit instead: the right answer followed by a second guess of the same question
    ("red or blue"); `exact_answer` reads the last word (or number), so a student that copies the habit is
    wrong even where it sees the image right (data/synthetic.hedging_teacher_rows does this for arithmetic)."""
    if not 0 <= error <= 1 or samples < 1:
        raise ValueError(f"error={error} must be in [0, 1] and samples={samples} >= 1")
    rng = random.Random(seed)
    out = []
    for row in rows:
        for _ in range(samples):
            answer = row["answer"]
            if rng.random() < error:
                other = rng.choice([a for a in ANSWERS[row["task"]] if a != row["answer"]])
                answer = f"{answer} or {other}" if hedge else other
            out.append({**row, "answer": answer})
    return out


def write_vision_task(
    out_dir: str | Path,
    *,
    num_train: int,
    num_test: int,
    seed: int = 0,
    size: int = 56,
    kinds: tuple[str, ...] = VISION_KINDS,
    teacher_error: float | None = None,
    teacher_samples: int = 2,
    teacher_hedge: bool = False,
) -> dict[str, Path]:
    """Write train.jsonl, test.jsonl and images/{train,test}_NNNNN.png (and sft.jsonl with `teacher_error`,
    its errors second guesses with `teacher_hedge`: noisy_teacher_rows);
    image paths in the rows are relative to out_dir, where the files lie. Returns {"train", "test"[, "sft"]}."""
    if num_train < 0 or num_test < 0:
        raise ValueError(f"num_train={num_train} and num_test={num_test} must be >= 0")
    out_dir = Path(out_dir)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    items = vision_items(num_train + num_test, seed=seed, size=size, kinds=kinds)
    splits: dict[str, list[dict]] = {"train": [], "test": []}
    for index, item in enumerate(items):
        split = "train" if index < num_train else "test"
        relative = f"images/{split}_{index:05d}.png"
        item.image.save(out_dir / relative)  # type: ignore[attr-defined]
        splits[split].append(vision_row(item, relative))
    paths = {split: write_jsonl(rows, out_dir / f"{split}.jsonl") for split, rows in splits.items()}
    if teacher_error is not None:
        sft = noisy_teacher_rows(
            splits["train"], error=teacher_error, samples=teacher_samples, seed=seed + 1, hedge=teacher_hedge
        )
        paths["sft"] = write_jsonl(sft, out_dir / "sft.jsonl")
    return paths
