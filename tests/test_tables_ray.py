"""A Ray Dataset (and a pandas DataFrame) passed to ``pt_ray.fit``: written once into the run
folder, trained on through Ray Train, and ending where the same rows given as Parquet files
end (the reference trainer's parameters, within 1e-4)."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from pt_ray.api import fit
from pt_ray.core.config import ConfigError

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]


def digits_frames():
    """scikit-learn's digits as two DataFrames of PNG bytes and labels (a few hundred rows)."""
    import io

    import numpy as np
    import pandas as pd
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    frames = []
    for rows in (range(0, 256), range(256, 320)):
        blobs = []
        for i in rows:
            pixels = (digits.images[i] * 255 / 16).astype(np.uint8)
            out = io.BytesIO()
            Image.fromarray(pixels).convert("RGB").save(out, format="PNG")
            blobs.append(out.getvalue())
        frames.append(pd.DataFrame({"image": blobs, "label": digits.target[list(rows)]}))
    return frames


def config(tmp_path, name: str, **data) -> dict:
    return {"name": name, "output_dir": str(tmp_path), "epochs": 2, "seed": 0,
            "model": {"family": "timm", "name": "vit_base_patch16_224", "depth": 2, "width": 32,
                      "num_heads": 2, "mlp_ratio": 2.0, "patch_size": 4},
            "data": {"name": "image_table", "image_size": 16, "batch_size": 32, **data},
            "pipeline": {"num_workers": 2}, "logging": {"report": False}}


def test_a_ray_dataset_trains_like_the_same_rows_in_parquet_files(ray_cluster, tmp_path):
    import ray

    train, evaluation = digits_frames()
    files = tmp_path / "files"
    files.mkdir()
    import pyarrow as pa

    pq.write_table(pa.Table.from_pandas(train, preserve_index=False), files / "train.parquet")
    pq.write_table(pa.Table.from_pandas(evaluation, preserve_index=False),
                   files / "validation.parquet")
    from_files = fit(config(tmp_path, "files", path=str(files)))
    from_ray = fit(config(tmp_path, "ray-data"), train_data=ray.data.from_pandas(train),
                   eval_data=evaluation)
    assert (tmp_path / "ray-data" / "data" / "train.parquet").is_file()
    assert from_ray.config.data.path == (tmp_path / "ray-data" / "data").resolve()
    assert [r.train_loss for r in from_ray.timeline] == pytest.approx(
        [r.train_loss for r in from_files.timeline], abs=1e-5)
    a, b = from_files.load_model().state_dict(), from_ray.load_model().state_dict()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-4


def test_in_memory_data_needs_a_table_dataset_and_both_splits(ray_cluster, tmp_path):
    train, evaluation = digits_frames()
    with pytest.raises(ConfigError, match="pass both train_data and eval_data"):
        fit(config(tmp_path, "one"), train_data=train)
    bad = config(tmp_path, "digits")
    bad["data"]["name"] = "digits"
    with pytest.raises(ConfigError, match="set data.name to text_table, qa_table or image_table"):
        fit(bad, train_data=train, eval_data=evaluation)
    with pytest.raises(ConfigError, match="train_data is a list; pass a Ray Dataset"):
        fit(config(tmp_path, "list"), train_data=[1, 2], eval_data=evaluation)
