"""The serving simulator: cost models and a discrete-event loop over the engine's own scheduler."""
