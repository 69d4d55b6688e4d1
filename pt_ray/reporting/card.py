"""The exported model's card: ``model/README.md`` in the Hugging Face model card layout (YAML
front matter, then prose), from the run's summary.

It says what the model was trained from (the base model, or a random initialisation), on which
data, how well it scores, how its blocks froze epoch by epoch, how much faster the run trained
than one that never froze (estimated from the first epoch's throughput, beside the freeze
timeline's ideal bound), and how to load it. Pure: a string from a dict.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pt_ray.core.datasets import DATASETS
from pt_ray.reporting.summary import ideal_speedup

__all__ = ["CARD", "model_card", "speedup_estimate"]

CARD = "README.md"

_TASKS = {"timm": "image-classification", "hf": "text-classification"}


def speedup_estimate(timeline: list[Mapping[str, Any]]) -> float | None:
    """How much faster the run trained than at its first epoch's pace throughout: the samples
    of every epoch at the first epoch's samples/s, over the time the epochs took. None when
    the timeline holds no timed epoch."""
    if not timeline or not timeline[0].get("throughput_samples_per_s"):
        return None
    first = timeline[0]["throughput_samples_per_s"]
    spent = sum(r["epoch_time_s"] + r.get("transition_time_s", 0.0) for r in timeline)
    samples = sum(r["throughput_samples_per_s"] * r["epoch_time_s"] for r in timeline)
    return (samples / first) / spent if spent > 0 else None


def _front_matter(summary: Mapping[str, Any], cfg: Mapping[str, Any], task: str) -> list[str]:
    model, data = cfg["model"], cfg["data"]
    family = "timm" if model["family"] == "timm" else "transformers"
    dataset = Path(str(data["path"])).name if data.get("path") else data["name"]
    metric = summary["metric_name"]
    lines = ["---", f"library_name: {family}", "tags:", "- pt-ray", "- pipetransformer",
             "- layer-freezing", f"- {task}"]
    if model.get("weights"):
        lines.append(f"base_model: {Path(str(model['weights'])).name}")
    lines += ["datasets:", f"- {dataset}", "metrics:", f"- {metric}", "model-index:",
              f"- name: {cfg['name']}", "  results:", "  - task:", f"      type: {task}",
              "    dataset:", f"      name: {dataset}", f"      type: {data['name']}",
              "    metrics:", f"    - type: {metric}",
              f"      value: {_number(summary.get('final_eval_metric'))}", "---", ""]
    return lines


def _number(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "null"
    return f"{value:.4f}"


def _timeline_table(timeline: list[Mapping[str, Any]], metric: str) -> list[str]:
    rows = [f"| epoch | frozen blocks | pipeline K | replicas R | samples/s | {metric} |",
            "|---|---|---|---|---|---|"]
    for r in timeline:
        rows.append(f"| {r['epoch'] + 1} | {r['num_frozen']} of {r['num_layers']} | "
                    f"{r['pipeline_length']} | {r['num_replicas']} | "
                    f"{r['throughput_samples_per_s']:,.0f} | {_number(r.get('eval_metric'))} |")
    return rows


def model_card(summary: Mapping[str, Any], load_python: str) -> str:
    """The card for a run's exported model.

    Args:
        summary: the run's ``summary.json`` as a dict (with its ``config``).
        load_python: the lines of Python that load the export (the export's ``README.txt``).
    """
    cfg = summary["config"]
    timeline = summary["timeline"]
    model, data = cfg["model"], cfg["data"]
    entry = DATASETS.get(data["name"])
    task = ("question-answering" if entry is not None and entry.question_answering
            else _TASKS[model["family"]])
    base = (f"fine-tuned from `{model['weights']}`" if model.get("weights")
            else "trained from a random initialisation")
    metric = summary["metric_name"]
    estimate, bound = speedup_estimate(timeline), ideal_speedup(timeline)
    speed = (f"about {estimate:.2f}x faster than at its first epoch's pace throughout "
             f"(the freeze timeline's ideal bound: {bound:.2f}x)" if estimate is not None
             else f"the freeze timeline's ideal bound is {bound:.2f}x")
    lines = _front_matter(summary, cfg, task) + [
        f"# {cfg['name']}", "",
        f"A {model['family']} `{model['name']}` model {base} by pt-ray on "
        f"`{data['name']}`" + (f" (`{data['path']}`)" if data.get("path") else "") +
        f" for {len(timeline)} epochs.", "",
        "## Results", "",
        f"- {metric} on the eval split after the last epoch: "
        f"{_number(summary.get('final_eval_metric'))}",
        f"- training: {speed}; wall time {summary['wall_time_s']:.0f} s on "
        f"{summary.get('device', 'the run devices')} ({summary.get('precision', '')})", "",
        "## Freeze timeline", "",
        f"pt-ray froze the leading blocks as their gradients settled (policy "
        f"`{cfg['freeze']['policy']}`, alpha {cfg['freeze']['alpha']}), shortened the pipeline "
        "and replicated it on the devices this freed:", "",
        *_timeline_table(timeline, metric), "",
        "## How to load", "",
        "```python", load_python.rstrip(), "```", ""]
    return "\n".join(lines)
