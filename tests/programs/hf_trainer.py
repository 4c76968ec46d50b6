"""The Hugging Face Trainer with evaluation and checkpoint steps."""
import tempfile

import torch
from _common import DEVICE, VOCAB, emit, llama
from transformers import Trainer, TrainingArguments
from transformers.trainer_callback import PrinterCallback

generator = torch.Generator().manual_seed(1)
rows = [{"input_ids": ids, "labels": ids}
        for ids in torch.randint(0, VOCAB, (24, 128), generator=generator)]
model = llama()
arguments = TrainingArguments(
    output_dir=tempfile.mkdtemp(), max_steps=6, per_device_train_batch_size=4,
    per_device_eval_batch_size=4, learning_rate=1e-3, eval_strategy="steps", eval_steps=3,
    save_strategy="steps", save_steps=3, logging_steps=1, report_to="none", seed=0,
    dataloader_num_workers=0, use_cpu=DEVICE == "cpu", disable_tqdm=True)
trainer = Trainer(model=model, args=arguments, train_dataset=rows[:16], eval_dataset=rows[16:])
trainer.remove_callback(PrinterCallback)  # its lines hold timings: the emitted ones compare
trainer.train()
for entry in trainer.state.log_history:
    if "loss" in entry:
        emit(f"step{entry['step']} loss", entry["loss"])
    if "eval_loss" in entry:
        emit(f"step{entry['step']} eval", entry["eval_loss"])
