"""picotron: a small, readable implementation of 5D-parallel LLM training, for learning.

Start with `picotron.launch.run` (run a function on N ranks), `picotron.mesh.Mesh` (the
process grid) and `picotron.model.Llama`; each technique lives in its own file under
picotron/parallel/, and `picotron.train` composes them. The modules and which way their imports
go: docs/design.md, "Layers". The course's tooling is the separate package picotron_course.
"""

__version__ = "0.1.0"
