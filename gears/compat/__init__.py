"""cell-gears's Python API (PertData, GEARS) over this package, and cell-gears's saved models."""
