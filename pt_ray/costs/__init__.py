"""Costs by prediction: the analytic cost model, hardware profiles, the pipeline simulator, the
planner that picks plans by predicted step time, and whole-run simulation. No torch, no Ray."""
