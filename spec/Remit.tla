-------------------------------- MODULE Remit --------------------------------
(***************************************************************************)
(* The Resume Contract as remit_core implements it.                        *)
(*                                                                         *)
(* One run of the probe workflow: it is paused at the interrupt "approve"  *)
(* (checkpoint at position 0); resuming consumes the interrupt (position   *)
(* 1), then runs N effect steps (effect e commits position e + 1); the run *)
(* is complete at position N + 1.  K resumers race for it.  Resumer r      *)
(* drives branch Drive[r]: branch 1 is main, branch 2 (if Forks = 1) is    *)
(* the branch a fork token names, created by a client from main.           *)
(*                                                                         *)
(* Store rows (one atomic transaction per resumer step):                   *)
(*   hpos, hval     branch head: position and the approved value it holds  *)
(*                  (compare-and-set by remit_core.policy.plan_commit)     *)
(*   base           fork base position (-1: the token was never used)      *)
(*   intr           the branch's interrupt: -1 none, 0 pending, r consumed *)
(*                  with resumer r's value                                 *)
(*   cHolder, cFence, cLapsed   the branch's claim row (acquire_claim)     *)
(*   ledger         effect ledger per (branch, effect): none/intent/done   *)
(* The outside world: applied[b][e], how often the effect really happened  *)
(* at its target.  Process memory: pc, fence, lpos/lval (the head read).   *)
(* History variables: faults (crash, zombie and bad-write budget), stale   *)
(* (a write under a superseded fence was accepted), stray (a branch        *)
(* without a fork token exists), doubt (an in-doubt effect was refused).   *)
(* Bug* constants switch on one seeded bug each.                           *)
(***************************************************************************)
EXTENDS Integers, FiniteSets, Sequences

CONSTANTS
    K,                  \* resumers 1..K
    N,                  \* effect steps
    Forks,              \* 0 or 1: is there a fork token
    Drive,              \* [1..K -> branches]: the branch each resumer drives
    Kind,               \* [1..N -> {"reconcile", "idempotent", "plain"}]
    MaxFaults,          \* budget of crashes, zombie lease lapses and bad writes
    Zombies,            \* a lease may lapse while its holder still runs (paused)
    Dedup,              \* effect targets ignore a repeated idempotency key
    BadWrites,          \* step code may produce a state that fails the schema
    BugNonAtomicClaim,  \* acquire_claim reads, then writes (no single statement)
    BugBlindRefire,     \* an effect found "intent" is re-applied blindly
    BugForkNoToken,     \* plan_commit forks a non-head parent without a token
    BugNoValidation,    \* the state schema is not checked before a commit
    BugNoFencing,       \* stores accept writes under a superseded fence
    BugLeaseNeverLapses \* a dead holder's lease never expires

Resumers == 1..K
Branches == 1..(1 + Forks)
Main     == 1
Final    == N + 1
Bad      == -1
Effects  == 1..N

Working == {"read", "consume", "commit", "effect", "begin", "apply", "reconcile",
            "finish", "release", "claimw"}
PCs == Working \cup {"idle", "lost", "done", "halted"}

VARIABLES pc, fence, lpos, lval, seen,
          hpos, hval, base, intr, cHolder, cFence, cLapsed, ledger, applied,
          doubt, faults, stale, stray

vars == <<pc, fence, lpos, lval, seen, hpos, hval, base, intr, cHolder, cFence, cLapsed,
          ledger, applied, doubt, faults, stale, stray>>

Exists(b)  == base[b] >= 0          \* main has base 0
Settled(b) == hpos[b] = Final \/ doubt[b]
\* policy.decide_claim: never claimed, released or lapsed -> grant_new; a
\* shim's claim() always presents a fresh holder, so "keep" never applies.
\* (Written with IF: TLC would branch on a disjunction in an action.)
Free(b)    == IF cHolder[b] = 0 THEN TRUE ELSE cLapsed[b]
\* The fence check every fenced primitive makes (SqlStore._check_fence).
CanWrite(r) == BugNoFencing \/ fence[r] = cFence[Drive[r]]
StaleNow(r) == fence[r] /= cFence[Drive[r]]

\* Checkpoint identity: the branch it was committed on and its position; a
\* fork's first head is main's checkpoint at the fork base.
HeadId(b)  == IF b = Main \/ hpos[b] = base[b] THEN <<Main, hpos[b]>> ELSE <<b, hpos[b]>>
LocalId(r) == IF Drive[r] = Main \/ lpos[r] = base[Drive[r]]
                THEN <<Main, lpos[r]>> ELSE <<Drive[r], lpos[r]>>

\* policy.plan_commit for a parent that is the resumer's local head: the
\* branch whose head it is (main before forks), or 0 (refused: a fork
\* resumer presents its token and gets HeadMoved; a main resumer gets
\* ForkWithoutIntent).
Target(r) ==
    IF Drive[r] = Main
      THEN IF HeadId(Main) = LocalId(r) THEN Main
           ELSE IF Forks = 1 /\ base[2] >= 0 /\ HeadId(2) = LocalId(r) THEN 2
           ELSE 0
      ELSE IF HeadId(Drive[r]) = LocalId(r) THEN Drive[r] ELSE 0

\* policy.effect_action
EffectAction(st, e) ==
    IF st = "none" THEN "apply"
    ELSE IF st = "done" THEN "return_recorded"
    ELSE IF BugBlindRefire THEN "reapply"
    ELSE IF Kind[e] = "reconcile" THEN "reconcile"
    ELSE IF Kind[e] = "idempotent" THEN "reapply"
    ELSE "in_doubt"

Go(r, s) == pc' = [pc EXCEPT ![r] = s]

\* Giving the claim up (ClaimHandle.release): a no-op unless still ours.
ReleaseClaim(r) ==
    LET b == Drive[r] IN
    IF cHolder[b] = r /\ cFence[b] = fence[r]
      THEN /\ cHolder' = [cHolder EXCEPT ![b] = 0]
           /\ cLapsed' = [cLapsed EXCEPT ![b] = TRUE]
      ELSE UNCHANGED <<cHolder, cLapsed>>

\* The resumer lets go of the run: its claim context releases the claim, and
\* what it had read is gone.
LetGo(r, s) ==
    /\ ReleaseClaim(r)
    /\ fence' = [fence EXCEPT ![r] = 0]
    /\ lpos' = [lpos EXCEPT ![r] = 0]
    /\ lval' = [lval EXCEPT ![r] = 0]
    /\ Go(r, s)

\* A primitive raised (Fenced, HeadMoved, ForkWithoutIntent, CheckpointInvalid).
Abort(r) == LetGo(r, "lost")

\* EffectInDoubt: the same, and the run stays refused until someone reconciles.
Halt(r) ==
    /\ LetGo(r, "halted")
    /\ doubt' = [doubt EXCEPT ![Drive[r]] = TRUE]

\* Where the effect protocol goes after reading ledger entry `st` (effects._protocol).
Decide(r, st, e) ==
    LET a == EffectAction(st, e) IN
    IF a = "in_doubt"
      THEN Halt(r)
      ELSE /\ Go(r, CASE a = "apply" -> "begin"
                      [] a = "return_recorded" -> "commit"
                      [] a = "reconcile" -> "reconcile"
                      [] a = "reapply" -> "apply")
           /\ UNCHANGED <<cHolder, cLapsed, fence, lpos, lval, doubt>>

(* ---- claims -------------------------------------------------------------- *)
Claim(r) ==
    LET b == Drive[r] IN
    /\ pc[r] = "idle" /\ Exists(b)
    /\ IF Free(b)
         THEN IF BugNonAtomicClaim
                THEN /\ seen' = [seen EXCEPT ![r] = cFence[b]]
                     /\ Go(r, "claimw")
                     /\ UNCHANGED <<cHolder, cFence, cLapsed, fence>>
                ELSE /\ cHolder' = [cHolder EXCEPT ![b] = r]
                     /\ cFence' = [cFence EXCEPT ![b] = cFence[b] + 1]
                     /\ cLapsed' = [cLapsed EXCEPT ![b] = FALSE]
                     /\ fence' = [fence EXCEPT ![r] = cFence[b] + 1]
                     /\ Go(r, "read")
                     /\ UNCHANGED seen
         ELSE /\ Go(r, "lost")
              /\ UNCHANGED <<cHolder, cFence, cLapsed, fence, seen>>
    /\ UNCHANGED <<lpos, lval, hpos, hval, base, intr, ledger, applied, doubt, faults,
                   stale, stray>>

ClaimWrite(r) ==                        \* the second half of the non-atomic claim
    LET b == Drive[r] IN
    /\ pc[r] = "claimw"
    /\ cHolder' = [cHolder EXCEPT ![b] = r]
    /\ cFence' = [cFence EXCEPT ![b] = seen[r] + 1]
    /\ cLapsed' = [cLapsed EXCEPT ![b] = FALSE]
    /\ fence' = [fence EXCEPT ![r] = seen[r] + 1]
    /\ seen' = [seen EXCEPT ![r] = 0]
    /\ Go(r, "read")
    /\ UNCHANGED <<lpos, lval, hpos, hval, base, intr, ledger, applied, doubt, faults,
                   stale, stray>>

(* ---- resumed execution ---------------------------------------------------- *)
Read(r) ==
    LET b == Drive[r] IN
    /\ pc[r] = "read"
    /\ lpos' = [lpos EXCEPT ![r] = hpos[b]]
    /\ lval' = [lval EXCEPT ![r] = hval[b]]
    /\ Go(r, IF hpos[b] = Final THEN "release" ELSE IF hpos[b] = 0 THEN "consume" ELSE "effect")
    /\ UNCHANGED <<fence, seen, hpos, hval, base, intr, cHolder, cFence, cLapsed, ledger,
                   applied, doubt, faults, stale, stray>>

\* Remit.consume: fence check, then pending -> consumed with our value; if it
\* was consumed already (by a holder that died), ResumeConflict for our value
\* and the run goes on with the recorded one (single read).
Consume(r) ==
    LET b == Drive[r] IN
    /\ pc[r] = "consume"
    /\ IF ~CanWrite(r)
         THEN Abort(r) /\ UNCHANGED <<intr, stale>>
         ELSE /\ IF intr[b] = 0
                   THEN /\ intr' = [intr EXCEPT ![b] = r]
                        /\ lval' = [lval EXCEPT ![r] = r]
                        /\ stale' = (stale \/ StaleNow(r))
                   ELSE /\ lval' = [lval EXCEPT ![r] = intr[b]]
                        /\ UNCHANGED <<intr, stale>>
              /\ Go(r, "commit")
              /\ UNCHANGED <<cHolder, cLapsed, fence, lpos>>
    /\ UNCHANGED <<seen, hpos, hval, base, cFence, ledger, applied, doubt, faults, stray>>

\* Remit.commit of the step's checkpoint holding value v: plan (CAS target),
\* fence check, compare-and-set of the head.
DoCommit(r, v) ==
    LET t == Target(r) IN
    IF t = 0
      THEN /\ Abort(r)
           /\ stray' = (stray \/ (BugForkNoToken /\ Drive[r] = Main))
           /\ UNCHANGED <<hpos, hval, stale>>
      ELSE IF ~CanWrite(r)
      THEN Abort(r) /\ UNCHANGED <<hpos, hval, stale, stray>>
      ELSE /\ hpos' = [hpos EXCEPT ![t] = lpos[r] + 1]
           /\ hval' = [hval EXCEPT ![t] = v]
           /\ lpos' = [lpos EXCEPT ![r] = lpos[r] + 1]
           /\ lval' = [lval EXCEPT ![r] = v]
           /\ stale' = (stale \/ StaleNow(r))
           /\ Go(r, IF lpos[r] + 1 = Final THEN "release" ELSE "effect")
           /\ UNCHANGED <<cHolder, cLapsed, fence, stray>>

Commit(r) ==
    /\ pc[r] = "commit"
    /\ DoCommit(r, lval[r])
    /\ UNCHANGED <<seen, base, intr, cFence, ledger, applied, doubt, faults>>

\* run_effect: read the ledger entry of the step's effect and decide.
Effect(r) ==
    /\ pc[r] = "effect"
    /\ Decide(r, ledger[Drive[r]][lpos[r]], lpos[r])
    /\ UNCHANGED <<seen, hpos, hval, base, intr, cFence, ledger, applied,
                   faults, stale, stray>>

\* store.begin_effect: fenced insert-if-absent of the intent.
Begin(r) ==
    LET b == Drive[r]
        e == lpos[r] IN
    /\ pc[r] = "begin"
    /\ IF ~CanWrite(r)
         THEN Abort(r) /\ UNCHANGED <<ledger, stale, doubt>>
         ELSE IF ledger[b][e] = "none"
         THEN /\ ledger' = [ledger EXCEPT ![b][e] = "intent"]
              /\ stale' = (stale \/ StaleNow(r))
              /\ Go(r, "apply")
              /\ UNCHANGED <<cHolder, cLapsed, fence, lpos, lval, doubt>>
         ELSE Decide(r, ledger[b][e], e) /\ UNCHANGED <<ledger, stale>>
    /\ UNCHANGED <<seen, hpos, hval, base, intr, cFence, applied, faults, stray>>

\* The external call: not fenceable.  The target ignores a repeated key if
\* the effect is idempotent or the target deduplicates.
Apply(r) ==
    LET b == Drive[r]
        e == lpos[r] IN
    /\ pc[r] = "apply"
    /\ applied' = IF (Kind[e] = "idempotent" \/ Dedup) /\ applied[b][e] >= 1
                    THEN applied
                    ELSE [applied EXCEPT ![b][e] = applied[b][e] + 1]
    /\ Go(r, "finish")
    /\ UNCHANGED <<fence, lpos, lval, seen, hpos, hval, base, intr, cHolder, cFence, cLapsed,
                   ledger, doubt, faults, stale, stray>>

\* The effect's reconcile hook asks the target: did key K happen?
Reconcile(r) ==
    /\ pc[r] = "reconcile"
    /\ Go(r, IF applied[Drive[r]][lpos[r]] >= 1 THEN "finish" ELSE "apply")
    /\ UNCHANGED <<fence, lpos, lval, seen, hpos, hval, base, intr, cHolder, cFence, cLapsed,
                   ledger, applied, doubt, faults, stale, stray>>

\* store.finish_effect: fenced intent -> done (done stays done).
Finish(r) ==
    LET b == Drive[r]
        e == lpos[r] IN
    /\ pc[r] = "finish"
    /\ IF ~CanWrite(r)
         THEN Abort(r) /\ UNCHANGED <<ledger, stale>>
         ELSE /\ ledger' = [ledger EXCEPT ![b][e] = "done"]
              /\ stale' = (stale \/ StaleNow(r))
              /\ Go(r, "commit")
              /\ UNCHANGED <<cHolder, cLapsed, fence, lpos, lval>>
    /\ UNCHANGED <<seen, hpos, hval, base, intr, cFence, applied, doubt, faults, stray>>

Release(r) ==
    /\ pc[r] = "release"
    /\ LetGo(r, "done")
    /\ UNCHANGED <<seen, hpos, hval, base, intr, cFence, ledger, applied, doubt,
                   faults, stale, stray>>

\* A resumer that got ResumeConflict (or was fenced) tries again once the
\* claim is free and the branch is not settled.
Retry(r) ==
    /\ pc[r] = "lost" /\ Free(Drive[r]) /\ ~Settled(Drive[r])
    /\ Go(r, "idle")
    /\ UNCHANGED <<fence, lpos, lval, seen, hpos, hval, base, intr, cHolder, cFence, cLapsed,
                   ledger, applied, doubt, faults, stale, stray>>

Step(r) == Claim(r) \/ ClaimWrite(r) \/ Read(r) \/ Consume(r) \/ Commit(r) \/ Effect(r)
           \/ Begin(r) \/ Apply(r) \/ Reconcile(r) \/ Finish(r) \/ Release(r) \/ Retry(r)

(* ---- faults ------------------------------------------------------------- *)
\* Crash-stop of the process, restarted at once with empty memory (a later
\* restart is the same as not being scheduled).  Its claim is not released.
Crash(r) ==
    /\ faults < MaxFaults /\ pc[r] \in Working
    /\ faults' = faults + 1
    /\ pc' = [pc EXCEPT ![r] = "idle"]
    /\ fence' = [fence EXCEPT ![r] = 0]
    /\ lpos' = [lpos EXCEPT ![r] = 0]
    /\ lval' = [lval EXCEPT ![r] = 0]
    /\ seen' = [seen EXCEPT ![r] = 0]
    /\ UNCHANGED <<hpos, hval, base, intr, cHolder, cFence, cLapsed, ledger, applied, doubt,
                   stale, stray>>

\* Step code produced a state that fails the schema: the shim's validation
\* raises CheckpointInvalid before anything is written.
BadWrite(r) ==
    /\ BadWrites /\ faults < MaxFaults /\ pc[r] = "commit"
    /\ faults' = faults + 1
    /\ IF BugNoValidation
         THEN DoCommit(r, Bad)
         ELSE Abort(r) /\ UNCHANGED <<hpos, hval, stale, stray>>
    /\ UNCHANGED <<seen, base, intr, cFence, ledger, applied, doubt>>

\* The lease lapses once the holder's incarnation stopped renewing it.
Expire(b) ==
    /\ ~BugLeaseNeverLapses
    /\ cHolder[b] /= 0 /\ ~cLapsed[b] /\ fence[cHolder[b]] /= cFence[b]
    /\ cLapsed' = [cLapsed EXCEPT ![b] = TRUE]
    /\ UNCHANGED <<pc, fence, lpos, lval, seen, hpos, hval, base, intr, cHolder, cFence,
                   ledger, applied, doubt, faults, stale, stray>>

\* A paused holder (a zombie): its lease lapses while it still believes it holds.
ZombieExpire(b) ==
    /\ Zombies /\ faults < MaxFaults
    /\ cHolder[b] /= 0 /\ ~cLapsed[b] /\ fence[cHolder[b]] = cFence[b]
    /\ faults' = faults + 1
    /\ cLapsed' = [cLapsed EXCEPT ![b] = TRUE]
    /\ UNCHANGED <<pc, fence, lpos, lval, seen, hpos, hval, base, intr, cHolder, cFence,
                   ledger, applied, doubt, stale, stray>>

(* ---- forks ----------------------------------------------------------------- *)
\* Remit.fork with a token, from the paused start or from main's head; a fork
\* of the paused run gets its own pending interrupt.
Fork(p) ==
    /\ Forks = 1 /\ base[2] = -1
    /\ base' = [base EXCEPT ![2] = p]
    /\ hpos' = [hpos EXCEPT ![2] = p]
    /\ hval' = [hval EXCEPT ![2] = IF p = 0 THEN 0 ELSE hval[Main]]
    /\ intr' = [intr EXCEPT ![2] = IF p = 0 THEN 0 ELSE -1]
    /\ UNCHANGED <<pc, fence, lpos, lval, seen, cHolder, cFence, cLapsed, ledger, applied,
                   doubt, faults, stale, stray>>

Init ==
    /\ pc = [r \in Resumers |-> "idle"]
    /\ fence = [r \in Resumers |-> 0]
    /\ lpos = [r \in Resumers |-> 0]
    /\ lval = [r \in Resumers |-> 0]
    /\ seen = [r \in Resumers |-> 0]
    /\ hpos = [b \in Branches |-> 0]
    /\ hval = [b \in Branches |-> 0]
    /\ base = [b \in Branches |-> IF b = Main THEN 0 ELSE -1]
    /\ intr = [b \in Branches |-> IF b = Main THEN 0 ELSE -1]
    /\ cHolder = [b \in Branches |-> 0]
    /\ cFence = [b \in Branches |-> 0]
    /\ cLapsed = [b \in Branches |-> TRUE]
    /\ ledger = [b \in Branches |-> [e \in Effects |-> "none"]]
    /\ applied = [b \in Branches |-> [e \in Effects |-> 0]]
    /\ doubt = [b \in Branches |-> FALSE]
    /\ faults = 0
    /\ stale = FALSE
    /\ stray = FALSE

Next ==
    \/ \E r \in Resumers : Step(r) \/ Crash(r) \/ BadWrite(r)
    \/ \E b \in Branches : Expire(b) \/ ZombieExpire(b)
    \/ \E p \in {0, hpos[Main]} : Fork(p)

Fairness == /\ \A r \in Resumers : WF_vars(Step(r))
            /\ \A b \in Branches : WF_vars(Expire(b))

Spec == Init /\ [][Next]_vars /\ Fairness

(* ---- the Resume Contract ---------------------------------------------------- *)
TypeOK ==
    /\ pc \in [Resumers -> PCs]
    /\ intr \in [Branches -> {-1, 0} \cup Resumers]
    /\ faults \in 0..MaxFaults

Holding(r) == pc[r] \in Working /\ fence[r] /= 0
Current(r) == Holding(r) /\ cHolder[Drive[r]] = r /\ cFence[Drive[r]] = fence[r]
AckVal(b)  == IF b /= Main /\ base[b] > 0 THEN intr[Main] ELSE intr[b]
RunsOn(b, e) == Exists(b) /\ e >= base[b]   \* effect e executes on branch b

\* P1: a resumer holding the current claim works exactly at the head.
NoRework == \A r \in Resumers :
    Current(r) /\ pc[r] \notin {"read", "claimw"} => lpos[r] = hpos[Drive[r]]
\* P2: no effect happens twice at its target; a recorded outcome is real;
\* a fork never runs the effects of its shared prefix.
EffectOnce     == \A b \in Branches, e \in Effects : applied[b][e] <= 1
LedgerTruthful == \A b \in Branches, e \in Effects : ledger[b][e] = "done" => applied[b][e] >= 1
ForkPrefixKept == \A b \in Branches, e \in Effects :
    ~RunsOn(b, e) => ledger[b][e] = "none" /\ applied[b][e] = 0
\* P3: every branch but main comes from a fork token.
ForkNeedsToken == ~stray
\* P4: every committed head satisfies the schema.
CheckpointValid == \A b \in Branches : hval[b] /= Bad
\* P5: one holder per fence; the run continues with the acknowledged value.
OneHolder == \A r1, r2 \in Resumers :
    r1 /= r2 /\ Drive[r1] = Drive[r2] /\ Holding(r1) /\ Holding(r2) => fence[r1] /= fence[r2]
AckedValue == \A b \in Branches : Exists(b) /\ hpos[b] >= 1 => hval[b] = AckVal(b) /\ hval[b] > 0
\* P6: a completed branch is the same whoever recovered it, however often.
RecoveryDeterminism == \A b \in Branches : hpos[b] = Final =>
    \A e \in Effects : RunsOn(b, e) => ledger[b][e] = "done" /\ applied[b][e] = 1
\* L2: a write under a superseded fence is never accepted.
FencedWrites == ~stale
\* L3: each branch's interrupt is consumed by a resumer of that branch only.
OwnInterrupts == \A b \in Branches : intr[b] > 0 => Drive[intr[b]] = b

Safety == /\ TypeOK /\ NoRework /\ EffectOnce /\ LedgerTruthful /\ ForkPrefixKept
          /\ ForkNeedsToken /\ CheckpointValid /\ OneHolder /\ AckedValue
          /\ RecoveryDeterminism /\ FencedWrites /\ OwnInterrupts

\* P1: a head moves one step at a time; P5: a consumed interrupt stays consumed.
HeadAdvances == [][\A b \in Branches : Exists(b) => hpos'[b] \in {hpos[b], hpos[b] + 1}]_hpos
ConsumeOnce  == [][\A b \in Branches : intr[b] > 0 => intr'[b] = intr[b]]_intr

\* L1: no run stays blocked: every driven branch ends complete or refused in doubt.
Termination == <>[](\A b \in Branches : Exists(b) /\ (\E r \in Resumers : Drive[r] = b)
                                         => Settled(b))
=============================================================================
