"""Train a tiny Llama (built from a config, no download) with HFCausalLM and the fused linear cross-entropy
loss, on CPU in well under a minute.

Batches follow the Hugging Face convention (``input_ids``, ``attention_mask``, ``labels = input_ids``; the
model shifts), with right padding of random lengths that the loss ignores. After training, ``generate``
runs on the model's normal logits path.

    python examples/hf_llama.py
"""

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_flce.models import HFCausalLM

VOCAB_SIZE = 256
SEQ_LEN = 32
PAD_ID = 0


class CountingSequences(Dataset):
    """Sequences ``s, s+1, s+2, ...`` (mod the vocabulary) of random lengths, right-padded."""

    def __init__(self, num_sequences: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        starts = torch.randint(1, VOCAB_SIZE, (num_sequences, 1), generator=generator)
        steps = torch.arange(SEQ_LEN)
        self.input_ids = (starts + steps - 1) % (VOCAB_SIZE - 1) + 1  # ids 1..V-1; 0 is padding
        lengths = torch.randint(SEQ_LEN // 2, SEQ_LEN + 1, (num_sequences, 1), generator=generator)
        self.attention_mask = (steps < lengths).long()
        self.input_ids = self.input_ids.masked_fill(self.attention_mask == 0, PAD_ID)

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        input_ids = self.input_ids[index]
        return {
            "input_ids": input_ids,
            "attention_mask": self.attention_mask[index],
            "labels": input_ids.clone(),
        }


def main() -> None:
    L.seed_everything(0)
    model = HFCausalLM(
        config={
            "model_type": "llama",
            "vocab_size": VOCAB_SIZE,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": SEQ_LEN,
            "tie_word_embeddings": True,
            "pad_token_id": PAD_ID,
        },
        lr=3e-3,
        warmup_steps=10,
        flce_chunk_size=256,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=80,
        log_every_n_steps=10,
        logger=False,
        enable_checkpointing=False,
    )
    val = DataLoader(CountingSequences(64, seed=2), batch_size=32)
    trainer.fit(model, DataLoader(CountingSequences(1024, seed=1), batch_size=32, shuffle=True), val)
    metrics = trainer.validate(model, val, verbose=False)[0]
    print(f"val/loss {metrics['val/loss']:.3f}  val/token_accuracy {metrics['val/token_accuracy']:.3f}")

    model.eval()
    prompt = torch.tensor([[10, 11, 12, 13]])
    with torch.no_grad():
        generated = model.model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=6,
            do_sample=False,
            pad_token_id=PAD_ID,
        )
    print(f"generate after {prompt[0].tolist()}: {generated[0, prompt.shape[1] :].tolist()}")


if __name__ == "__main__":
    main()
