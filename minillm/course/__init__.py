"""The course around the chapters: the top layer, which may import every chapter.

`cli` (the `minillm` command), `tour` (runs each chapter's tour entry named in `minillm.chapters`), `assignment`
(stubs and grading), `notebooks` (executes the labs) and `gpu_report` (the tour and tests on a GPU, as a report).
"""
