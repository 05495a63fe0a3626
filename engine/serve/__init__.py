"""The serving engine's pieces: building the engine, the process around the tick loop, its watchers and feeds."""
