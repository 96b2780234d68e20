// Kept for outside programs written against the first release: the header moved to mori/channels/.
#pragma once
#include "mori/channels/memory_channel.hpp"
