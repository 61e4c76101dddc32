"""chunkmem inside the training loops people already have: Hugging Face ``Trainer`` and Accelerate
(:mod:`chunkmem.integrations.transformers`) and Lightning (:mod:`chunkmem.integrations.lightning`). Each
module imports its library only when it is imported itself."""
