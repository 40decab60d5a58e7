"""Several engines serving one workload: prefill/decode disaggregation over the process-group layer (``disagg``)."""
