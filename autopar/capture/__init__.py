"""The front end: traces a model into the joint forward+backward graph (on fake tensors), and the
stage graphs of a pipeline."""
