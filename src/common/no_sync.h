// The one piece of state apex::amp and apex::parallel share: how many gradient-accumulation scopes
// without synchronization (apex::parallel::NoSyncGuard) are open on this thread. apex::amp refuses
// a scale_loss that would unscale (and so stash) gradients inside one, whose backward is not
// all-reduced. Owned here so that neither depends on the other.
#pragma once

namespace apex::detail {

/// This thread's count of open NoSyncGuards.
int& open_no_sync_scopes();

}  // namespace apex::detail
