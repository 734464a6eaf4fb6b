#!/usr/bin/env bash
# Multi-turn RL on one of textarena's single-player games (the `textarena` environment, extra rlkit[textarena]):
# GuessTheNumber, a secret in 1..20, one guess a turn written as [N], the game answering "The target number is
# higher." or "lower.", won (reward 1) by guessing right within TURNS turns, else lost (reward 0: reward=win; the
# game's own shaped reward pays a lost game for the last guess's closeness, which "always guess 10" farms).
#   sft on a noisy player's games, played through the same adapter (bisection, counting up or random guesses,
#   never against the feedback) -> freeze-ref -> ROUNDS x (rollout --env textarena | score-ref | update) -> the
#   final policy's games, held-out seeds.
# The embedded tiny model's context (256 characters) does not hold the game's rules, so the prompt is a short one
# (PROMPT); with a real model leave PROMPT empty for the game's own opening message.
# The closing table shows, per round, the games' success rate and their mean number of turns, then the SFT and the
# final policy's greedy games on held-out seeds. At the defaults on 2 CPU cores (about 6 minutes): SEED 0 from
# 43.9% of sampled games won (the SFT policy) to 54.0% in round 6, held-out greedy games 55.5% -> 67.2%; SEED 1
# from 48.7% to 54.6% (56.8% in round 5), held-out 70.3% -> 78.9%.
# Knobs (environment), defaults in brackets:
#   RUNS [runs/textarena]  SEED [0]  MODEL [tiny]  SFT_GAMES [3000]  GAME [GuessTheNumber-v0]  TURNS [6]
#   PROMPT [Guess 1-20 as [N]:\n]  BISECT [0.4]  LINEAR [0.3] the SFT player's shares of middle and lowest guesses
#   ROUNDS [6]  PROMPTS [128] games per round  N [8] per game  ALGO [grpo]  LR [3e-4]  EPOCHS [2]  MINIBATCH [128]
#   BETA [0.01]  KL [k3+]  TEMPERATURE [1.0]  FINAL [128] held-out games of the final policy (and of the SFT one)
# A rerun skips every stage whose output is up to date with its inputs and settings.
set -euo pipefail

. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

defaults RUNS=runs/textarena SEED=0 MODEL=tiny SFT_GAMES=3000 GAME=GuessTheNumber-v0 TURNS=6
PROMPT=${PROMPT-'Guess 1-20 as [N]:\n'}
defaults BISECT=0.4 LINEAR=0.3 ROUNDS=6 PROMPTS=128 N=8 ALGO=grpo LR=3e-4 EPOCHS=2 MINIBATCH=128 BETA=0.01 KL=k3+
defaults TEMPERATURE=1.0 FINAL=128
# textarena's GuessTheNumber allows max_turns + 1 guesses; the game ends itself, the driver's limit is a backstop
MAX_TURNS=$((TURNS + 1))
ENV="textarena:game=$GAME,max_turns=$TURNS,reward=win,stop=\\n,max_new_tokens=6${PROMPT:+,prompt=$PROMPT}"

mkdir -p "$RUNS"
start_times

# SFT transcripts: a noisy player's games against the environment itself, token for token as a rollout holds them
t0=$(now)
python3 - "$ENV" "$SFT_GAMES" "$SEED" "$BISECT" "$LINEAR" "$RUNS/sft-games.jsonl" <<'PY'
import json, random, re, sys
from rlkit.envs import get_env

spec, games, seed, bisect, linear, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5]), sys.argv[6]
env_spec = get_env(spec)
rng = random.Random(f"textarena-sft|{seed}")
proto = env_spec.make()
rows = []
for ex in proto.iter_examples("train", seed):
    if len(rows) == games:
        break
    env = env_spec.make()
    prompt = env.reset(ex)
    lo, hi, text = 1, 20, ""
    while True:
        u = rng.random()
        g = (lo + hi) // 2 if u < bisect else lo if u < bisect + linear else rng.randint(lo, hi)
        action = f"[{g}]\n"
        text += action
        step = env.step(action)
        if step.observation is None:
            break
        text += step.observation
        if "higher" in step.observation:
            lo = g + 1
        elif "lower" in step.observation:
            hi = g - 1
    env.close()
    rows.append({"prompt": prompt, "completion": text})
with open(out, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
PY
rlkit sft --model "$MODEL" --data "$RUNS/sft-games.jsonl" --seed "$SEED" --out "$RUNS/sft"
rlkit freeze-ref --policy "$RUNS/sft" --out "$RUNS/ref" --dtype bf16
log_time sft "$t0"

# one round: the games of the policy going in (kept), scored by the reference, trained on
knobs="env=$ENV prompts=$PROMPTS n=$N algo=$ALGO lr=$LR epochs=$EPOCHS mb=$MINIBATCH beta=$BETA kl=$KL temp=$TEMPERATURE seed=$SEED"
env_rounds "$MAX_TURNS"
# held-out games (seeds never trained on), greedy: the SFT policy's and the final policy's
for who in sft final; do
  p="$RUNS/sft"; [ "$who" = final ] && p="$policy"
  t0=$(now)
  rlkit eval --policy "$p" --env "$ENV" --max-turns "$MAX_TURNS" --num-prompts "$FINAL" --label "$who" --json \
    > "$RUNS/eval-$who.json"
  log_time "eval-$who" "$t0"
done

inspect_rollouts
summary "$RUNS" "$ROUNDS" "$TURNS" <<'PY'
runs, rounds, turns = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
times = wall_times(runs)
games_table(26)
for i in range(1, rounds + 1):
    fig = json.load(open(f"{runs}/rollouts-{i}.json"))["multi_turn"]
    wall = f"{times[f'round-{i}']:.1f}" if f"round-{i}" in times else "-"
    games_row(f"round {i} (sampled)", 26, "sft" if i == 1 else f"round-{i - 1}", fig, wall)
for who, policy in (("sft", "sft"), ("final", f"round-{rounds}")):
    ev = json.load(open(f"{runs}/eval-{who}.json"))
    print(f"{'held-out (greedy)':26}{policy:>10}{ev['mean_reward']:>10.1%}{ev.get('mean_turns', float('nan')):>12.2f}"
          f"{ev['n']:>7}{times['eval-' + who]:>8.1f}")
print(f"success: games won (textarena's max_turns={turns}: {turns + 1} guesses); mean turns: per game, won or lost")
PY
