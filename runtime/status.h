// Moved to questkv/status.h; this forward goes once every includer names it.
#pragma once
#include "questkv/status.h"
