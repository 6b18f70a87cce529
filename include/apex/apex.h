#pragma once

/// Umbrella header: everything apex-cpp offers.
#include <apex/amp/autocast.h>
#include <apex/amp/grad_scaler.h>
#include <apex/amp/initialize.h>
#include <apex/amp/loss_scaler.h>
#include <apex/amp/options.h>
#include <apex/amp/scale_loss.h>
#include <apex/amp/utils.h>
#include <apex/io.h>
#include <apex/normalization.h>
#include <apex/optim.h>
#include <apex/parallel.h>
#include <apex/serialize.h>
