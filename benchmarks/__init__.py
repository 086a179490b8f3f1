"""The benchmark: manyheads against its CPU peers, the NumPy oracle and SGEMM.

Not part of the installed package; run it from a source checkout with
``python benchmarks/run.py`` (``--help`` lists the sections and peers).

* ``run``       - the command line and the order of the run;
* ``cases``     - what the attention and module sections time;
* ``inference`` - the inference section and its subprocesses;
* ``peers``     - PyTorch, ONNX Runtime and OpenVINO calls, checked before timing;
* ``timing``    - medians of interleaved rounds;
* ``results``   - the typed results and their JSON form;
* ``claims``    - the claims a user can check, met or not;
* ``report``    - the markdown report and the plot.

Every figure is a ratio measured in one run on one machine (medians of
repeated calls); nothing here is an absolute claim.
"""
