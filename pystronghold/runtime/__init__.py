"""The layer-window runtime: store, window, schedule, engine."""
