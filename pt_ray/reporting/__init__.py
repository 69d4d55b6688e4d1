"""What a run writes and shows: the summary contract, reports, sweep reports, TensorBoard
events, progress lines, step logs and logging set-up. No torch, no Ray."""
