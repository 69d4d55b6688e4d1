"""The training workers' log holds pt-ray's lines, not Ray Train's per-report dumps."""

from __future__ import annotations

import logging

import pytest

pytestmark = pytest.mark.unit


def test_ray_train_report_lines_are_silenced_by_their_file_named_logger(caplog):
    from ray.train.v2._internal.execution import context

    from pt_ray.service.worker import quiet_ray_train

    logger = logging.getLogger(context.__file__)
    before = logger.level
    try:
        logger.setLevel(logging.NOTSET)
        caplog.set_level(logging.INFO)
        # The very call Ray Train makes for each report (its module logger, at INFO): shown
        # by default, not once the worker has quietened Ray Train.
        context.logger.info("Reporting training result 1: TrainingReport(...) from rank 0")
        assert "Reporting training result 1" in caplog.text
        quiet_ray_train()
        context.logger.info("Reporting training result 2: TrainingReport(...) from rank 0")
        assert "Reporting training result 2" not in caplog.text
        assert not logger.isEnabledFor(logging.INFO)
        assert logger.isEnabledFor(logging.WARNING)
    finally:
        logger.setLevel(before)
