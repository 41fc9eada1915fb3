"""Weight-only quantization: int8 and 4-bit (round-to-nearest, HQQ) weights as linear
methods (methods.py), chosen per layer by a product policy (policy.py), multiplied by
kernels compiled for the CPU at hand (kernels.py, csrc/qlinear.cpp)."""
