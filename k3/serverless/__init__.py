"""k3.serverless: serverless multi-LoRA training, a Tinker-shaped service (`k3 serve`) and its Python client.

    from k3.serverless import ServiceClient, Datum, ModelInput, AdamParams, SamplingParams
    service = ServiceClient("http://127.0.0.1:8000")
    training = service.create_lora_training_client(base_model="k3-tiny", rank=16)
    training.forward_backward([Datum(...)], "cross_entropy")
    training.optim_step(AdamParams(learning_rate=1e-3))
    sampler = training.save_weights_and_get_sampling_client("v1")
    sampler.sample(ModelInput.from_ints(prompt), num_samples=4, sampling_params=SamplingParams(max_tokens=16))

The server side (`k3.serverless.service`, `.server`) imports torch and the model; the client and the types do not.
"""
from k3.serverless.types import (AdamParams, Datum, ForwardBackwardOutput, ModelInput, OptimStepOutput,
                                 SampledSequence, SampleResponse, SamplingParams, ServiceError)

_LAZY = {"ServiceClient": "client", "TrainingClient": "client", "SamplingClient": "client",
         "ServeConfig": "config", "Service": "service"}


def __getattr__(name: str):
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AdamParams", "Datum", "ForwardBackwardOutput", "ModelInput", "OptimStepOutput", "SampleResponse",
           "SampledSequence", "SamplingClient", "SamplingParams", "ServeConfig", "Service", "ServiceClient",
           "ServiceError", "TrainingClient"]
