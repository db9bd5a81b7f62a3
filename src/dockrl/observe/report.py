"""`dockrl report RUN_DIR [RUN_DIR ...]`: a run's figures as PNG plots and one HTML page.

    RUN_DIR/metrics.jsonl, samples.jsonl, summary.json, config.yaml
        -> OUT/report/*.png   reward and accuracy, response length, KL and entropy, clipping and grad norm,
                              throughput, the stage timeline per step (stacked bars), eval accuracy
        -> OUT/report.html    the plots, the runs' settings that matter, sample responses of the last steps

OUT is the run directory for one run; several runs (drawn on the same axes, one colour each) need --out.
matplotlib draws headless (the Agg backend): no display is needed.
"""

from __future__ import annotations

import base64
import html
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dockrl.observe import metric_names as names
from dockrl.observe.loggers import image_text

# (file, title, [(metric, label)], y-axis label); a figure is drawn when any run has any of its metrics.
LINE_PLOTS = [
    (
        "reward.png",
        "Reward and accuracy",
        [(names.REWARD_MEAN, "reward mean"), (names.TRAIN_ACCURACY, "train accuracy")],
        "",
    ),
    (
        "length.png",
        "Response length",
        [(names.RESPONSE_LENGTH_MEAN, "mean"), (names.RESPONSE_LENGTH_MAX, "max")],
        "tokens",
    ),
    (
        "truncated.png",
        "Responses cut at max_new_tokens",
        [(names.RESPONSE_TRUNCATED_FRAC, "share")],
        "share",
    ),
    (
        "kl_entropy.png",
        "KL to the reference and entropy",
        [(names.ACTOR_KL, "KL"), (names.ACTOR_ENTROPY, "entropy")],
        "nats",
    ),
    (
        "clip.png",
        "Share of tokens the ratio clip acted on",
        [(names.ACTOR_CLIP_FRAC, "all"), (names.ACTOR_CLIP_FRAC_HIGH, "above 1 + clip_high")],
        "share",
    ),
    ("grad_norm.png", "Gradient norm (before clipping)", [(names.ACTOR_GRAD_NORM, "grad norm")], ""),
    (
        "throughput.png",
        "Throughput",
        [
            (names.THROUGHPUT_TOKENS_PER_S, "step tokens/s"),
            (names.THROUGHPUT_ROLLOUT_TOKENS_PER_S, "rollout tokens/s"),
            (names.THROUGHPUT_UPDATE_TOKENS_PER_S, "update tokens/s"),
        ],
        "tokens/s",
    ),
    ("eval.png", "Held-out accuracy", [(names.EVAL_ACCURACY, "eval accuracy")], ""),
    (
        "distill.png",
        "Distillation: reverse KL to the teacher per sampled token",
        [(names.DISTILL_REVERSE_KL, "reverse KL")],
        "nats",
    ),
]
# Stages of the step timeline that do not overlap one another (the reward's time past the rollout's is its own).
TIMELINE = [
    (names.TIMING_WEIGHT_SYNC, "weight sync"),
    (names.TIMING_ROLLOUT, "rollout (incl. switch)"),
    ("reward_after_rollout", "reward after rollout"),
    (names.TIMING_REFERENCE, "reference"),
    (names.TIMING_OLD_LOGPROBS, "old log-probs"),
    (names.TIMING_CRITIC_VALUES, "critic values"),
    (names.TIMING_UPDATE, "update"),
    ("other", "other"),
]
SAMPLES_SHOWN = 8


@dataclass
class Run:
    """One run directory's records."""

    name: str
    path: Path
    metrics: list[dict[str, Any]]
    samples: list[dict[str, Any]]
    summary: dict[str, Any]
    config: dict[str, Any]

    @classmethod
    def read(cls, path: str | Path) -> Run:
        """Read RUN_DIR's files; a directory without metrics.jsonl is a FileNotFoundError naming it."""
        import yaml

        path = Path(path)
        metrics_file = path / "metrics.jsonl"
        if not metrics_file.is_file():
            raise FileNotFoundError(f"{path} is not a run directory: it has no metrics.jsonl")
        metrics = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
        samples_file = path / "samples.jsonl"
        samples = (
            [json.loads(line) for line in samples_file.read_text().splitlines() if line.strip()]
            if samples_file.is_file()
            else []
        )
        summary = json.loads((path / "summary.json").read_text()) if (path / "summary.json").is_file() else {}
        config = (
            yaml.safe_load((path / "config.yaml").read_text()) if (path / "config.yaml").is_file() else {}
        )
        return cls(path.name, path, metrics, samples, summary, config or {})

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of metric `key` where it was logged (null values skipped)."""
        points = [(m["step"], m[key]) for m in self.metrics if m.get(key) is not None]
        return [s for s, _ in points], [float(v) for _, v in points]


def write_report(run_dirs: list[str | Path], out: str | Path | None = None) -> dict[str, Any]:
    """Draw the plots and write report.html; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    runs = [Run.read(path) for path in run_dirs]
    names = [run.name for run in runs]
    if len(set(names)) < len(names):  # e.g. two demos' grpo/ runs: name them by their parent too
        for run in runs:
            run.name = f"{run.path.parent.name}-{run.path.name}"
    if out is None:
        if len(runs) > 1:
            raise ValueError("several runs need --out DIR (the report of one run goes into its directory)")
        out = runs[0].path
    out = Path(out)
    images = out / "report"
    images.mkdir(parents=True, exist_ok=True)
    written = []
    for file, title, metrics, ylabel in LINE_PLOTS:
        if _line_plot(runs, images / file, title, metrics, ylabel):
            written.append(file)
    for run in runs:
        file = f"timeline_{run.name}.png" if len(runs) > 1 else "timeline.png"
        if _timeline(run, images / file):
            written.append(file)
    page = out / "report.html"
    page.write_text(_html(runs, written))
    return {"report": str(page), "plots": [str(images / f) for f in written]}


def _line_plot(runs: list[Run], path: Path, title: str, metrics: list[tuple[str, str]], ylabel: str) -> bool:
    import matplotlib.pyplot as plt

    lines = [(run, key, label) for run in runs for key, label in metrics if run.series(key)[0]]
    if not lines:
        return False
    figure, axis = plt.subplots(figsize=(7, 3.6), dpi=110)
    styles = ["-", "--", ":", "-."]
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    keys = [k for k, _ in metrics]
    for run, key, label in lines:
        steps, values = run.series(key)
        # One run: a colour per metric. Several: a colour per run, a line style per metric.
        colour = colours[(keys.index(key) if len(runs) == 1 else runs.index(run)) % len(colours)]
        style = "-" if len(runs) == 1 else styles[keys.index(key) % len(styles)]
        name = label if len(runs) == 1 else f"{run.name}: {label}"
        axis.plot(
            steps, values, style, color=colour, marker="o" if len(steps) < 25 else None, ms=3, label=name
        )
        std_key = key.replace(f"/{names.MEAN}", f"/{names.STD}")
        if len(runs) == 1 and key.endswith(f"/{names.MEAN}") and run.series(std_key)[0]:  # +- one std
            _, std = run.series(std_key)
            lower = [v - s for v, s in zip(values, std)]
            upper = [v + s for v, s in zip(values, std)]
            axis.fill_between(steps, lower, upper, color=colour, alpha=0.12, linewidth=0)
    axis.set_title(title)
    axis.set_xlabel("step")
    axis.set_ylabel(ylabel)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8, loc="best")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return True


def _timeline(run: Run, path: Path) -> bool:
    """Stacked bars of each step's non-overlapping stages; 'other' is the rest of timing/step."""
    import matplotlib.pyplot as plt

    rows = [m for m in run.metrics if m.get(names.TIMING_STEP) is not None]
    if not rows:
        return False
    steps = [m["step"] for m in rows]

    def part(m: dict, key: str) -> float:
        if key == "reward_after_rollout":
            return max(0.0, (m.get(names.TIMING_REWARD) or 0.0) - (m.get(names.TIMING_ROLLOUT) or 0.0))
        if key == "other":
            known = sum(part(m, k) for k, _ in TIMELINE if k != "other")
            return max(0.0, m[names.TIMING_STEP] - known)
        return float(m.get(key) or 0.0)

    figure, axis = plt.subplots(figsize=(7, 3.6), dpi=110)
    bottom = [0.0] * len(rows)
    for key, label in TIMELINE:
        heights = [part(m, key) for m in rows]
        if not any(heights):
            continue
        axis.bar(steps, heights, bottom=bottom, label=label, width=0.8)
        bottom = [b + h for b, h in zip(bottom, heights)]
    axis.set_title(f"Where each step's time went ({run.name})")
    axis.set_xlabel("step")
    axis.set_ylabel("seconds")
    axis.grid(axis="y", alpha=0.3)
    axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return True


def _html(runs: list[Run], plots: list[str]) -> str:
    esc = html.escape
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>dockrl report</title>",
        "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}"
        "img{max-width:100%;margin:0.5em 0}table{border-collapse:collapse;font-size:0.9em}"
        "td,th{border:1px solid #ccc;padding:4px 8px;vertical-align:top;text-align:left}"
        "pre{white-space:pre-wrap;margin:0}</style></head><body>",
        f"<h1>dockrl report: {esc(', '.join(r.name for r in runs))}</h1>",
        "<h2>Runs</h2><table><tr><th>run</th><th>algorithm</th><th>model</th><th>steps</th>"
        "<th>final reward</th><th>eval accuracy</th></tr>",
    ]
    for run in runs:
        last = run.metrics[-1] if run.metrics else {}
        algo = (run.config.get("algo") or {}).get("name", "")
        model = (run.config.get("model") or {}).get("path", "")
        eval_acc = run.summary.get("eval_accuracy", last.get(names.EVAL_ACCURACY))
        parts.append(
            f"<tr><td>{esc(run.name)}</td><td>{esc(str(algo))}</td><td>{esc(str(model))}</td>"
            f"<td>{len(run.metrics)}</td><td>{_fmt(last.get(names.REWARD_MEAN))}</td><td>{_fmt(eval_acc)}</td></tr>"
        )
    parts.append("</table><h2>Plots</h2>")
    parts += [f"<img src='report/{esc(p)}' alt='{esc(p)}'>" for p in plots]
    for run in runs:
        shown = run.samples[-SAMPLES_SHOWN:]
        if not shown:
            continue
        with_images = any(
            s.get("images") for s in shown
        )  # a vision-language run: the image beside the answer
        parts.append(f"<h2>Samples of {esc(run.name)} (the last {len(shown)})</h2><table>")
        parts.append(
            "<tr><th>step</th>"
            + ("<th>image</th>" if with_images else "")
            + "<th>prompt</th><th>response</th><th>label</th><th>reward</th></tr>"
        )
        for s in shown:
            parts.append(
                f"<tr><td>{s.get('step')}</td>"
                + (f"<td>{_images_cell(s.get('images') or [])}</td>" if with_images else "")
                + f"<td><pre>{esc(str(s.get('prompt', '')))}</pre></td>"
                f"<td>{_response_cell(s)}</td><td>{esc(str(s.get('label', '')))}</td>"
                f"<td>{_fmt(s.get('reward'))}{_components(s)}</td></tr>"
            )
        parts.append("</table>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _response_cell(sample: dict[str, Any]) -> str:
    """A sample's response; a multi-turn one as its whole trajectory, each turn labelled (observations too)."""
    esc = html.escape
    turns = sample.get("turns")
    if not turns:
        return f"<pre>{esc(str(sample.get('response', '')))}</pre>"
    return "".join(
        f"<div class='{esc(t['role'])}'><b>{esc(t['role'])}</b> ({t.get('tokens', '?')} tokens)"
        f"<pre>{esc(str(t.get('text', '')))}</pre></div>"
        for t in turns
    )


def _images_cell(images: list[dict[str, Any]]) -> str:
    """A sample's images embedded as data URIs (the page stays one file), each with its reference and size;
    an image whose file is gone, or given inline (base64:, bytes: refs: samples.jsonl never holds pixels),
    shows its reference alone."""
    cells = []
    for image in images:
        ref = str(image.get("ref", ""))
        uri = _data_uri(Path(ref)) if Path(ref).is_absolute() else None
        picture = (
            f"<img src='{uri}' alt='{html.escape(ref)}' style='width:112px;image-rendering:pixelated'><br>"
            if uri
            else ""
        )
        cells.append(f"<div>{picture}<small>{html.escape(image_text(image))}</small></div>")
    return "".join(cells)


def _data_uri(path: Path) -> str | None:
    """The file as a data: URI (its type from its first bytes), or None when it is not a readable image."""
    if not path.is_file():
        return None
    data = path.read_bytes()
    kinds = {b"\x89PNG": "png", b"\xff\xd8\xff": "jpeg", b"GIF8": "gif", b"RIFF": "webp", b"BM": "bmp"}
    kind = next((k for magic, k in kinds.items() if data.startswith(magic)), None)
    return None if kind is None else f"data:image/{kind};base64,{base64.b64encode(data).decode()}"


def _components(sample: dict[str, Any]) -> str:
    """A multi-turn sample's reward components (env, rule functions, shaping), under its total."""
    components = sample.get("components") or {}
    return "".join(f"<br><small>{html.escape(k)} {_fmt(v)}</small>" for k, v in components.items())


def _fmt(value: Any) -> str:
    return "" if value is None else f"{value:.4g}" if isinstance(value, float) else html.escape(str(value))


def scaling_plot(rows: list[dict[str, Any]], path: str | Path) -> bool:
    """`dockrl bench scaling`'s rows as one figure: step seconds against response length (log-log), and seconds
    per TFLOP of the step's work, a line per (model size, system); False when no row has a time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if "step_s" in r]
    if not timed:
        return False
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4), dpi=110)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    sizes = list(dict.fromkeys(r["size"] for r in timed))
    for system, style in (("dockrl", "-"), ("trl", "--")):
        for size in sizes:
            line = sorted(
                (r for r in timed if r["system"] == system and r["size"] == size), key=lambda r: r["length"]
            )
            if not line:
                continue
            colour = colours[sizes.index(size) % len(colours)]
            label = f"{system} {size} ({line[0]['params_m']:.1f}M)"
            lengths = [r["length"] for r in line]
            left.plot(
                lengths, [r["step_s"] for r in line], style, color=colour, marker="o", ms=3, label=label
            )
            right.plot(lengths, [r["s_per_tflop"] for r in line], style, color=colour, marker="o", ms=3)
    for axis, title, ylabel in (
        (left, "Step time", "seconds per step"),
        (right, "Time per unit of work (flat: grows as the work)", "seconds per TFLOP"),
    ):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("max new tokens")
        axis.set_ylabel(ylabel)
        axis.set_title(title)
        axis.grid(alpha=0.3, which="both")
    left.legend(fontsize=7, loc="best")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return True
