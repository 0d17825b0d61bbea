"""The course around the chapters: the top layer, which may import every chapter.

`cli` (the `minillm` command), `tour` (runs each chapter's tour entry named in `minillm.chapters`), `assignment`
(stubs and grading), `grading` / `grader_child` / `sandbox` / `probes` (the grader's parent, the child process that
runs student code, the namespaces that isolate it, and the data each exercise is judged on outside the child),
`notebooks` (executes the labs), `includes` (the package source shown in the chapter texts), `results` (the measured tables and numbers the texts
quote, from committed results files and notebook outputs), `roadmap` (the course
figure), `figures` (the notebooks' plots the chapter texts show, copied out of the notebooks), `diagrams` (the
explanatory diagrams of chapters 08-13, drawn by code), `labels` (point labels that do not overlap, for the
notebooks' scatter plots) and `gpu_report` (the tour and tests on a GPU, as a report).
"""
