"""The estimator's calibration: compiling external attention kernels, whose sources are not part of
this repository, for the targets their published measurements were made on."""
