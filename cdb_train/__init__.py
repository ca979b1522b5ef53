"""Training a small Ouro-architecture looped LM on CPU, and its lookahead exit gate.

Pipeline (``python -m cdb_train --help``): ``prepare`` fetches and splits the corpus (Debian's ``bible-kjv-text``)
and trains the BPE tokenizer; ``train`` trains the looped LM with Ouro's objective and writes a checkpoint folder
in the Hugging Face layout ``cdb_model.loader`` reads; ``lookahead`` distils the lookahead gate from the frozen
same-step gate and measures one-step-ahead decisions; ``card`` writes the loss curve and the model card.

The model trained is ``cdb_model.ouro.OuroLM`` itself (the serving modules), run over whole sequences through a
batched causal ``KVAccess``: the tensors it saves are by construction the ones the loader and the reference path
read.
"""
