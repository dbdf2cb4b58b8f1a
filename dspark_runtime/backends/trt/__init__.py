"""TensorRT: the engine decoder, the DSpark drafter's engine, optimisation profiles, and the loader that
picks enterprise TensorRT or TensorRT for RTX."""
