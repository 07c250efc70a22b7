def resume_step(checkpoint_every, steps_per_epoch, fault_step):
    saved = [step for step in range(1, fault_step + 1)
             if step % checkpoint_every == 0 or step % steps_per_epoch == 0]  # every N steps, and each epoch end
    return max(saved, default=0)  # the newest one; 0 when there is none yet
