"""The pure core: run configuration, freeze policies, partitions, plans and the control state
that turns costs and norms into plans. No torch, no Ray."""
