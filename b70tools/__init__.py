"""The appliance's tools: benchmarks, the load test and the soak (run through scripts/), and
the GPU fixture trees they share with the tests. Their dependencies are the `test` extra."""
