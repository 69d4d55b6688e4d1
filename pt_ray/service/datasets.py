"""In-memory data handed to :func:`pt_ray.fit` (a Ray Dataset, a pyarrow Table or a pandas
DataFrame), written once into the run folder as Parquet so that every worker reads the same
rows in the same order: the sample index is the row's position, which the sample order, the
activation cache and the reference trainer key on.

The rows travel through the driver: a Ray Dataset is materialised there (its blocks fetched
from the object store) and written as one file per split. That suits what fits the driver's
memory and the run folder's disk, up to a few GB; beyond it, write the dataset to Parquet
where the workers can read it (``ds.write_parquet``) and point ``data.path`` at the folder.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pt_ray.core.config import ConfigError

__all__ = ["DATA_FOLDER", "as_arrow", "materialise"]

logger = logging.getLogger(__name__)

DATA_FOLDER = "data"
"""Where in the run folder the splits are written."""


def as_arrow(data: Any, field: str):
    """``data`` as one pyarrow Table.

    Raises:
        ConfigError: ``data`` is none of a Ray Dataset, a pyarrow Table, a pandas DataFrame.
    """
    import pyarrow as pa

    if isinstance(data, pa.Table):
        return data
    if type(data).__name__ == "DataFrame" and hasattr(data, "to_numpy"):
        return pa.Table.from_pandas(data, preserve_index=False)
    if hasattr(data, "to_arrow_refs"):  # a Ray Dataset
        import ray

        blocks = ray.get(data.to_arrow_refs())
        return pa.concat_tables(blocks) if blocks else pa.table({})
    raise ConfigError(f"{field} is a {type(data).__name__}; pass a Ray Dataset, a pyarrow Table "
                      "or a pandas DataFrame")


def materialise(run_dir: Path, train_data: Any, eval_data: Any) -> list[str]:
    """Write both splits under ``run_dir/data`` and return the overrides that point the run's
    ``data`` section at them.

    Raises:
        ConfigError: a split is of an unknown type, empty, or missing.
    """
    import pyarrow.parquet as pq

    if train_data is None or eval_data is None:
        raise ConfigError("pass both train_data and eval_data (the eval split scores every "
                          "epoch), or neither and set data.path")
    folder = Path(run_dir) / DATA_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    for split, data, field in (("train", train_data, "train_data"),
                               ("validation", eval_data, "eval_data")):
        table = as_arrow(data, field)
        if table.num_rows == 0:
            raise ConfigError(f"{field} holds no rows; pass at least one")
        pq.write_table(table, folder / f"{split}.parquet")
        logger.info("%s: %d rows, columns %s -> %s", field, table.num_rows, table.column_names,
                    folder / f"{split}.parquet")
    return [f"data.path={folder.resolve()}", "data.train_split=train",
            "data.eval_split=validation"]
