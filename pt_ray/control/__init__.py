"""The run's decision state: freeze policy, guard, planner and timeline in one object.

Pure (no torch, no Ray), and above the pure folders it combines: ``core`` (config, freeze
policies, plans), ``costs`` (the cost planner and hardware profiles) and ``reporting`` (the
epoch records it keeps). The Ray controller actor (``pt_ray.service.controller``) and the
single-process engines (``pt_ray.runtime``) wrap :mod:`pt_ray.control.state`.
"""
