"""The model-executing worker: a ForwardBatch in, a ForwardResult out, on a CPU or GPU backend."""
