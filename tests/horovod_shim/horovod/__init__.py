"""A stand-in `horovod` package for running Horovod's own test files against ddlfast.horovod
(tests/horovod_shim/README.md): `import horovod.torch as hvd` gets ddlfast.horovod.torch. Test harness only; never
installed with ddlfast."""
