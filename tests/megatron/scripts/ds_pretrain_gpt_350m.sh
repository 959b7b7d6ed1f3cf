#!/bin/bash
# A 350M GPT with Megatron-DeepSpeed: options built in a string, a heredoc for the DeepSpeed config, eval of the command.
set -ex
BASE_PATH=./tmp
DS_CONFIG=${BASE_PATH}/deepspeed.json
TP=2
PP=2
NLAYERS=24
HIDDEN=1024
GLOBAL_BATCH=64
MICRO_BATCH=4
ZERO_STAGE=1
options=" \
	--tensor-model-parallel-size $TP \
	--pipeline-model-parallel-size $PP \
        --num-layers $NLAYERS \
        --hidden-size $HIDDEN \
        --num-attention-heads 16 \
        --seq-length 1024 \
        --loss-scale 12 \
        --max-position-embeddings 1024 \
	--micro-batch-size $MICRO_BATCH \
	--global-batch-size $GLOBAL_BATCH \
	--train-iters 1000 \
        --lr 6.0e-5 \
	--min-lr 6.0e-6 \
        --lr-decay-style cosine \
        --log-interval 1 \
        --eval-iters 40 \
        --eval-interval 1000 \
	--data-path ${DATASET} \
	--vocab-file ${BASE_PATH}/gpt2-vocab.json \
	--merge-file ${BASE_PATH}/gpt2-merges.txt \
	--save-interval 1000 \
        --split 98,2,0 \
        --clip-grad 1.0 \
	--weight-decay 0.1 \
	--adam-beta1 0.9 \
	--adam-beta2 0.95 \
	--init-method-std 0.006 \
        --fp16 \
	--checkpoint-activations \
        --tensorboard-dir $OUTPUT_DIR
        "
options="${options} \
		--deepspeed \
		--deepspeed_config=${DS_CONFIG} \
		--zero-stage=${ZERO_STAGE} \
		--deepspeed-activation-checkpointing \
	"
cat <<EOT > $DS_CONFIG
{
  "train_batch_size" : $GLOBAL_BATCH,
  "zero_optimization": { "stage": $ZERO_STAGE }
}
EOT
run_cmd="deepspeed --num_gpus 8 pretrain_gpt.py ${options}"
echo ${run_cmd}
eval ${run_cmd}
set +x
